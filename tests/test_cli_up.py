"""``kvstrata up`` when ``ray start`` fails: one line naming Ray's error, exit 1, nothing left
behind (a busy machine's failed ``ray start`` once ended ``up`` with a CalledProcessError
traceback and a stray temp directory)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import lifecycle
from cli import main as cli


def test_a_failed_ray_start_is_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(lifecycle, "_free_port", lambda: taken.getsockname()[1])  # Ray's GCS cannot bind
        made: list[str] = []
        real_mkdtemp = lifecycle.tempfile.mkdtemp

        def mkdtemp(**kwargs: str) -> str:  # the real one, remembering the directory
            made.append(real_mkdtemp(**kwargs))
            return made[-1]

        monkeypatch.setattr(lifecycle.tempfile, "mkdtemp", mkdtemp)
        result = CliRunner().invoke(cli.app, ["up"], env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"),
                                                          "COLUMNS": "1000"})
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("kvstrata up failed: `ray start --head --port="), result.output
    assert "Error" in lines[0] and "Traceback" not in result.output
    assert made and not Path(made[0]).exists()  # the temp directory is gone
    assert not (tmp_path / "cli" / "gateway.json").exists()


def test_ray_start_error_prefers_the_exception_line() -> None:
    stderr = "Traceback (most recent call last):\n  File x\nRuntimeError: Failed to start GCS. Last lines:\n" \
             "\x1b[31mport taken\x1b[0m\n"
    assert lifecycle._ray_start_error(stderr, "INFO started") == \
        "RuntimeError: Failed to start GCS. Last lines: port taken"
    assert lifecycle._ray_start_error("", "line one\nline two\n") == "line two"
