"""gateway.json, the state ``kvstrata up`` saves for the other commands (``cli.state``): written
atomically and owner-only, and a file that is no saved state (cut short by a crash) is ignored
with a warning rather than failing every command."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli import state


@pytest.mark.parametrize("text", [b"", b'{"ray_address": "127.0.0.1:6', b"\x00" * 64, b"[1, 2]", b"{" + b" " * (1 << 20) + b"}",
                                  b"[" * 60_000],
                         ids=["empty", "cut_short", "zeros", "no_object", "past_bound", "nested_past_recursion"])
def test_a_state_file_cut_short_is_ignored_not_a_traceback(tmp_path: Path, text: bytes) -> None:
    """Regression (s38 durability audit): ``up`` wrote gateway.json in place and every command
    parsed it unchecked, so a file a crash cut short made ``down`` (and ``up``, and every
    client command) end in a JSONDecodeError traceback until someone deleted it. Now ``down``
    says there is nothing to stop and removes it, and a client command says there is no
    gateway to talk to."""
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir(mode=0o700)
    path = cli_dir / "gateway.json"
    path.write_bytes(text)
    env = {"KVSTRATA_STATE_DIR": str(cli_dir), "COLUMNS": "1000"}
    listed = CliRunner().invoke(cli.app, ["tenant", "list"], env=env)
    assert listed.exit_code == 1 and isinstance(listed.exception, SystemExit), (listed.output, listed.exception)
    assert "no gateway address" in listed.output and "is no state kvstrata saved" in listed.output
    down = CliRunner().invoke(cli.app, ["down"], env=env)
    assert down.exit_code == 0 and down.exception is None, (down.output, down.exception)
    assert "nothing to stop" in down.output
    assert not path.exists()


def test_saved_state_is_owner_only_and_replaced_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``write_state`` replaces an older file (here one left 0644) by a 0600 one, through a temp
    file renamed over it (none is left), and ``read_state`` reads back what was saved."""
    monkeypatch.setenv("KVSTRATA_STATE_DIR", str(tmp_path))
    tmp_path.chmod(0o700)
    (tmp_path / state.STATE_FILE).write_text("{}")
    (tmp_path / state.STATE_FILE).chmod(0o644)
    inode = (tmp_path / state.STATE_FILE).stat().st_ino
    saved = {"address": "127.0.0.1:50051", "ray_token_path": str(tmp_path / "ray_token"), "started_ray": True}
    state.write_state(saved)
    st = os.stat(tmp_path / state.STATE_FILE)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == [state.STATE_FILE]
    assert state.read_state() == saved == json.loads((tmp_path / state.STATE_FILE).read_text())
