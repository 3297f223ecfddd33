"""The one codegen script: compile ``proto/kvstrata/v1/*.proto`` into ``kvstrata/v1/``.

Usage (from anywhere; paths are resolved from this file)::

    python proto/codegen.py           # regenerate the checked-in code in place
    python proto/codegen.py --check   # regenerate into a temp dir, compare bytes;
                                      # exit 1 and list the files that differ

For every ``<name>.proto`` protoc writes ``<name>_pb2.py``, ``<name>_pb2_grpc.py`` and
``<name>_pb2.pyi``. Hand-written files in the package (``__init__.py``) are left alone.
The output is byte-for-byte what
``python -m grpc_tools.protoc -I proto --python_out=. --grpc_python_out=. --pyi_out=. ...``
produces with the installed ``grpcio-tools``, which ``pyproject.toml`` pins (the dev extra) to
the release that generated the checked-in files: each release writes its own version into the
stubs (``GRPC_GENERATED_VERSION``, the oldest grpcio they accept).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_PACKAGE = Path("kvstrata/v1")
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(repo_root: Path = REPO_ROOT) -> list[Path]:
    """Return the ``.proto`` sources under ``<repo_root>/proto/kvstrata/v1``, sorted.

    Raises:
        FileNotFoundError: there are no ``.proto`` files (wrong ``repo_root``).
    """
    sources = sorted((repo_root / "proto" / PROTO_PACKAGE).glob("*.proto"))
    if not sources:
        raise FileNotFoundError(f"no .proto files under {repo_root / 'proto' / PROTO_PACKAGE}")
    return sources


def generate(out_root: Path, repo_root: Path = REPO_ROOT) -> list[Path]:
    """Compile every proto into ``out_root`` (which plays the repository root).

    Returns:
        The generated files, relative to ``out_root`` (e.g. ``kvstrata/v1/tenant_pb2.py``),
        sorted.

    Raises:
        RuntimeError: protoc failed (its diagnostics are on stderr).
    """
    proto_root = repo_root / "proto"
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(str(path) for path in proto_files(repo_root)),
        f"-I{well_known}",
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {proto_root} (see its errors above)")
    return sorted(_generated_in(out_root))


def stale_files(repo_root: Path = REPO_ROOT) -> list[Path]:
    """Regenerate into a temporary directory and compare with the checked-in code.

    Returns:
        Paths relative to ``repo_root`` that differ: changed, missing from the checkout,
        or checked in without a ``.proto`` that produces them. Empty when up to date.
    """
    with tempfile.TemporaryDirectory(prefix="kvstrata-codegen-") as tmp:
        fresh_root = Path(tmp)
        fresh = set(generate(fresh_root, repo_root))
        checked_in = set(_generated_in(repo_root))
        differing = {
            rel
            for rel in fresh
            if rel not in checked_in
            or not filecmp.cmp(fresh_root / rel, repo_root / rel, shallow=False)
        }
        return sorted(differing | (checked_in - fresh))


def _generated_in(root: Path) -> list[Path]:
    package = root / PROTO_PACKAGE
    if not package.is_dir():
        return []
    return [
        path.relative_to(root)
        for path in package.iterdir()
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES)
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the script; returns the process exit code (1 when ``--check`` finds drift)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="compare with checked-in code, write nothing"
    )
    args = parser.parse_args(argv)
    if not args.check:
        written = generate(REPO_ROOT)
        for orphan in set(_generated_in(REPO_ROOT)) - set(written):
            (REPO_ROOT / orphan).unlink()
            print(f"removed {orphan} (no .proto produces it)")
        print(f"generated {len(written)} files in {REPO_ROOT / PROTO_PACKAGE}")
        return 0
    differing = stale_files()
    if not differing:
        print("generated code is up to date")
        return 0
    print("generated code differs from proto/ (run `python proto/codegen.py`):", file=sys.stderr)
    for rel in differing:
        print(f"  {rel}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
