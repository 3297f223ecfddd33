"""The state directory and the spill directories are refused when another user could change
them (``services.private_dir``), at every place that makes or trusts one: ``kvstrata up``,
the GlobalScheduler (``tenants.sqlite``), each spill node, the Ray token file, the CLI's saved
state and ``admin rotate-key --local``.

Regression (security review 23d): the directories were made with ``mkdir(mode=0o700,
exist_ok=True)``, which keeps an existing directory's mode, so a group- or world-writable
state directory was used as it was and another user could replace ``tenants.sqlite`` or
``admin_key`` in it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli import lifecycle
from cli import main as cli
from services import private_dir
from services.global_scheduler import GlobalScheduler
from services.private_dir import UnsafeDirectoryError, ensure_private_dir
from services.ray_auth import TOKEN_FILE, new_token_file
from services.spill_node import SpillNode
from tests.test_spill_store import BLOCK, DISK, FMT


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def made_with_mode(path: Path, mode: int) -> Path:
    path.mkdir()
    path.chmod(mode)
    return path


def test_a_missing_directory_is_made_0700_with_its_parents(tmp_path: Path) -> None:
    made = ensure_private_dir(tmp_path / "a" / "state")
    assert made == tmp_path / "a" / "state" and mode_of(made) == 0o700


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711])
def test_a_directory_only_its_owner_may_write_is_accepted_as_it_is(tmp_path: Path, mode: int) -> None:
    state = made_with_mode(tmp_path / "state", mode)
    ensure_private_dir(state)
    assert mode_of(state) == mode


@pytest.mark.parametrize(("mode", "writers"), [(0o777, "its group and others"), (0o770, "its group"),
                                               (0o702, "others"), (0o1777, "its group and others")])
def test_a_directory_others_may_write_is_refused_naming_it_and_the_fix(tmp_path: Path, mode: int,
                                                                       writers: str) -> None:
    state = made_with_mode(tmp_path / "state", mode)
    with pytest.raises(UnsafeDirectoryError) as refused:
        ensure_private_dir(state)
    assert str(refused.value) == (
        f"{state} is writable by {writers} (mode {mode & 0o7777:04o}): another user could replace the files "
        f"kvstrata keeps there. Run `chmod 700 {state}` (or at least `chmod go-w {state}`)")
    assert isinstance(refused.value, PermissionError)
    assert mode_of(state) == mode  # refused, not changed


def test_a_directory_of_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = made_with_mode(tmp_path / "state", 0o700)
    me = os.geteuid()
    monkeypatch.setattr(private_dir.os, "geteuid", lambda: me + 1)  # as another user sees our directory
    with pytest.raises(UnsafeDirectoryError, match=rf"^{state} is owned by uid {me}, not by this user "
                                                   rf"\(uid {me + 1}\).*`chown {me + 1} {state}`"):
        ensure_private_dir(state)


def test_the_scheduler_refuses_a_writable_state_dir_before_opening_the_tenant_database(tmp_path: Path) -> None:
    state = made_with_mode(tmp_path / "state", 0o777)
    with pytest.raises(UnsafeDirectoryError, match="chmod 700"):
        GlobalScheduler(str(state), {"n0": 1})
    assert not (state / "tenants.sqlite").exists()
    state.chmod(0o700)
    GlobalScheduler(str(state), {"n0": 1}).store.close()
    assert (state / "tenants.sqlite").exists()


def test_a_spill_node_refuses_a_writable_directory(tmp_path: Path) -> None:
    spill = made_with_mode(tmp_path / "spill", 0o775)
    with pytest.raises(UnsafeDirectoryError, match="chmod 700"):
        SpillNode(spill, FMT, 4 * BLOCK, DISK, node_id="spill_node_0")
    node = SpillNode(tmp_path / "spill_new" / "0", FMT, 4 * BLOCK, DISK, node_id="spill_node_0")
    assert node.node_id == "spill_node_0" and mode_of(tmp_path / "spill_new" / "0") == 0o700


def test_the_ray_token_is_not_written_into_a_writable_directory(tmp_path: Path) -> None:
    state = made_with_mode(tmp_path / "state", 0o777)
    with pytest.raises(UnsafeDirectoryError):
        new_token_file(state)
    assert not (state / TOKEN_FILE).exists()


def test_up_refuses_a_writable_state_dir_before_starting_anything(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvstrata up`` exits 1 with one line naming the directory and the fix; no Ray is
    started and nothing is written there."""
    monkeypatch.setattr(lifecycle, "_start_local_ray", lambda *a: pytest.fail("Ray was started"))
    state = made_with_mode(tmp_path / "state", 0o777)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"gateway_port": 0, "http_port": 0, "state_dir": str(state)}))
    result = CliRunner().invoke(cli.app, ["up", "--config", str(config)],
                                env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "1000"})
    assert result.exit_code == 1, result.output
    assert result.output.strip() == (
        f"kvstrata up failed: {state} is writable by its group and others (mode 0777): another user could "
        f"replace the files kvstrata keeps there. Run `chmod 700 {state}` (or at least `chmod go-w {state}`)")
    assert list(state.iterdir()) == []


def test_commands_refuse_saved_state_another_user_could_have_written(tmp_path: Path) -> None:
    """gateway.json names the gateway the admin key goes to: in a world-writable directory it
    is not trusted (exit 1, naming the directory), and ``admin rotate-key --local`` writes no
    key next to a tenant database there."""
    cli_dir = made_with_mode(tmp_path / "cli", 0o777)
    (cli_dir / "gateway.json").write_text(json.dumps({"address": "127.0.0.1:9", "state_dir": str(cli_dir)}))
    (cli_dir / "tenants.sqlite").write_bytes(b"")
    for args in (["tenant", "list"], ["admin", "rotate-key", "--local"]):
        result = CliRunner().invoke(cli.app, args, env={"KVSTRATA_STATE_DIR": str(cli_dir), "COLUMNS": "1000"})
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith(f"{cli_dir} is writable by its group and others"), (args, result.output)
    assert not (cli_dir / "admin_key").exists()
