"""A killed process's child temp directories are removed by the next one made of their kind
(diff review s35 R6: a cache node killed by ``ray.kill`` left its chat renderer's tokenizer copy,
~3.4 MB, and its children's working directories in the temp directory for good, one set per
start). Real processes: one killed with SIGKILL, one alive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from cache_node.process_temp import process_temp_dir

MAKE = ("import sys, time; from cache_node.process_temp import process_temp_dir; "
        "print(process_temp_dir('probe-test'), flush=True); time.sleep(120)")


def _holder(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", MAKE], stdout=subprocess.PIPE, text=True, env=env)
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_processs_dirs_go_and_a_live_ones_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # (read again from TMPDIR)
    killed, killed_dir = _holder(tmp_path)
    live, live_dir = _holder(tmp_path)
    try:
        (killed_dir / "tokenizer.json").write_text("{}")
        assert killed_dir.is_dir() and live_dir.is_dir() and killed_dir.parent == tmp_path
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        other_host = tmp_path / f"kvstrata-probe-test-{killed.pid}-x"  # a dead pid, another host's
        other_host.mkdir()
        (other_host / ".kvstrata-owner").write_text("some-other-host")
        unowned = tmp_path / f"kvstrata-probe-test-{killed.pid}-y"  # no owner file: not ours to judge
        unowned.mkdir()
        mine = Path(process_temp_dir("probe-test"))
        assert not killed_dir.exists()  # before: kept for good
        assert live_dir.is_dir() and other_host.is_dir() and unowned.is_dir() and mine.is_dir()
        assert mine.name.startswith(f"kvstrata-probe-test-{os.getpid()}-") and oct(mine.stat().st_mode)[-3:] == "700"
    finally:
        live.kill()
        live.wait(10)
