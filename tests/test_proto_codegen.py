"""The checked-in ``kvstrata/v1`` code is exactly what ``proto/codegen.py`` produces."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTOS = ("admin", "common", "inference", "tenant")


def _load_codegen() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "kvstrata_codegen", REPO_ROOT / "proto/codegen.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


codegen = _load_codegen()


def _copy_repo_subset(dst: Path) -> None:
    shutil.copytree(REPO_ROOT / "proto" / "kvstrata", dst / "proto" / "kvstrata")
    shutil.copytree(
        REPO_ROOT / "kvstrata", dst / "kvstrata", ignore=shutil.ignore_patterns("__pycache__")
    )


def test_generated_files_match_checked_in_bytes(tmp_path: Path) -> None:
    """Guards against editing a .proto without regenerating (or hand-editing generated code)."""
    generated = codegen.generate(tmp_path)

    expected = sorted(
        Path("kvstrata/v1") / f"{name}{suffix}"
        for name in PROTOS
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    )
    assert generated == expected
    for rel in generated:
        fresh = (tmp_path / rel).read_bytes()
        checked_in = (REPO_ROOT / rel).read_bytes()
        assert fresh == checked_in, f"{rel} is stale: run `python proto/codegen.py`"
    assert codegen.stale_files() == []


def test_check_detects_a_changed_proto(tmp_path: Path) -> None:
    """The comparison can fail: a new field in tenant.proto makes tenant_pb2* stale."""
    _copy_repo_subset(tmp_path)
    proto = tmp_path / "proto/kvstrata/v1/tenant.proto"
    proto.write_text(proto.read_text() + "\nmessage Extra { string note = 1; }\n")

    assert codegen.stale_files(tmp_path) == [
        Path("kvstrata/v1/tenant_pb2.py"),
        Path("kvstrata/v1/tenant_pb2.pyi"),
    ]


def test_check_detects_missing_and_orphaned_files(tmp_path: Path) -> None:
    _copy_repo_subset(tmp_path)
    (tmp_path / "kvstrata/v1/admin_pb2_grpc.py").unlink()
    (tmp_path / "kvstrata/v1/old_pb2.py").write_text("# left over from a deleted proto\n")

    assert codegen.stale_files(tmp_path) == [
        Path("kvstrata/v1/admin_pb2_grpc.py"),
        Path("kvstrata/v1/old_pb2.py"),
    ]


def test_check_mode_exit_code_on_the_repository() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "proto/codegen.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout == "generated code is up to date\n"
