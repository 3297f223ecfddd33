"""Directories of spill nodes a deployment no longer runs are deleted at its start
(``services.spill_dirs``), and nothing else.

Regression (review 26b F4): after a start with fewer spill nodes (``num_spill_nodes``), the
directories ``<state_dir>/spill/<j>`` of the indices past the count were never opened again:
never swept of deleted tenants, outside every disk budget, their group files' headers keeping
tenants' prompt token ids for good.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cache_node.tiers import spill_format
from services import launcher, spill_dirs
from services.config import ServiceConfig
from services.spill_dirs import METRICS_PORT_FILE, remove_retired_spill_dirs
from services.spill_node import SpillNode
from services.spill_recreate import SpillRecipe
from tests.test_spill_store import DISK, FMT, files_in, hashes_of, make_blocks


def spill_node_dir(root: Path, index: int, namespace: str = "tenant:a") -> Path:
    """``<root>/<index>`` as a spill node leaves it: 0700, group files, a quarantined file, a
    temp file of an unfinished write and its metrics port."""
    path = root / str(index)
    node = SpillNode(path, FMT, ram_bytes=0, disk_bytes=DISK)
    node.put(hashes_of([index, 100 + index]), make_blocks([0, 1]), namespace, [[index] * 4, [index] * 4])
    node.put(hashes_of([200 + index]), make_blocks([2]), namespace, [[7] * 4])
    (bad,) = [p for p in files_in(path) if spill_format.read_header(p).block_hashes == (hashes_of([200 + index])[0],)]
    bad.write_bytes(b"\xff" * 64 + bad.read_bytes()[64:])
    assert node.get(hashes_of([200 + index])).hashes == []  # quarantined
    (path / (spill_format.TEMP_PREFIX + "x.part")).write_bytes(b"half")
    (path / METRICS_PORT_FILE).write_text("9100\n")
    node.close()  # its process is gone: the directory's lock with it
    return path


def tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links not followed): file bytes, link targets, "dir"."""
    out: dict[str, bytes | str] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory) / name
            rel = str(path.relative_to(root))
            out[rel] = (f"-> {os.readlink(path)}" if path.is_symlink()
                        else "dir" if path.is_dir() else path.read_bytes())
    return out


def test_directories_of_retired_spill_nodes_are_deleted_and_the_others_kept(tmp_path: Path) -> None:
    root = tmp_path / "state" / "spill"
    for i in range(4):
        spill_node_dir(root, i)
    assert [len(files_in(root / str(i))) for i in range(4)] == [1] * 4
    assert [len(os.listdir(root / str(i) / spill_format.QUARANTINE_DIR)) for i in range(4)] == [1] * 4
    kept = {k: v for k, v in tree(root).items() if k.split(os.sep)[0] in ("0", "1")}
    assert remove_retired_spill_dirs(root, 2) == ["2", "3"]
    assert sorted(os.listdir(root)) == ["0", "1"] and tree(root) == kept
    assert remove_retired_spill_dirs(root, 2) == []
    assert remove_retired_spill_dirs(tmp_path / "missing", 0) == []


def test_a_spill_node_deletes_its_retired_siblings_on_its_own_machine(tmp_path: Path) -> None:
    """A spill volume on another machine than the launcher's: each spill node deletes the
    retired directories next to its own at its start."""
    root = tmp_path / "spill"
    for i in range(3):
        spill_node_dir(root, i)
    SpillNode(root / "0", FMT, ram_bytes=0, disk_bytes=DISK, num_spill_nodes=1)
    assert os.listdir(root) == ["0"]


def test_the_launcher_deletes_them_whatever_the_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``num_spill_nodes: 0`` starts no spill node; the launcher still deletes the directories
    of the ones the last start ran (``<state_dir>/spill``, or ``spill_dir``)."""
    monkeypatch.setattr(launcher, "_wait_placed", lambda *args: None)
    state = tmp_path / "state"
    spill_node_dir(state / "spill", 0, "tenant:secret")
    none = SpillRecipe((), FMT, 0, DISK, "kvstrata", launcher.SCHEDULER_NAME)  # no node to create
    assert launcher._start_spill_nodes(ServiceConfig(state_dir=str(state), num_spill_nodes=0), none) == []
    assert os.listdir(state / "spill") == []
    other = tmp_path / "elsewhere"
    spill_node_dir(other, 0)
    config = ServiceConfig(state_dir=str(state), spill_dir=str(other), num_spill_nodes=0)
    launcher._start_spill_nodes(config, none)
    assert os.listdir(other) == []


def test_only_what_a_spill_node_made_is_deleted_and_no_link_is_followed(tmp_path: Path) -> None:
    outside = spill_node_dir(tmp_path / "outside", 0)
    target = files_in(outside)[0]
    before = tree(tmp_path / "outside")
    root = tmp_path / "spill"
    for name in ("010", "x", "-1", "\u0661\u0663"):  # not canonical decimal indices (Arabic-Indic 13)
        spill_node_dir(root, 99).rename(root / name)
    spill_node_dir(root, 0)
    (root / "5").symlink_to(outside)  # a link to a spill node's directory: not followed, kept
    spill_node_dir(root, 6)
    (root / "6" / "notes.txt").write_text("mine")  # something a spill node does not write
    spill_node_dir(root, 7).chmod(0o770)  # writable by its group: not one a spill node made
    quarantine = spill_node_dir(root, 8) / spill_format.QUARANTINE_DIR
    for f in quarantine.iterdir():
        f.unlink()
    quarantine.rmdir()
    quarantine.symlink_to(outside / spill_format.QUARANTINE_DIR)  # a quarantine that links out
    spill_node_dir(root, 9)
    (root / "9" / "link.kvs").symlink_to(target)  # a link under a group file's name: unlinked
    (root / "10").write_bytes(b"a file")
    (spill_node_dir(root, 12) / "sub.kvs").mkdir()  # a directory under a group file's name
    kept = {k: v for k, v in tree(root).items() if k.split(os.sep)[0] != "9"}
    assert remove_retired_spill_dirs(root, 1) == ["9"]
    assert tree(root) == kept
    assert tree(tmp_path / "outside") == before


def test_a_spill_root_others_may_write_or_a_linked_one_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever else may write the spill root could rename a live node's directory to a retired
    index: nothing in such a root is deleted, nor through a root that is a link, nor a
    directory of another user."""
    root = tmp_path / "spill"
    spill_node_dir(root, 1)
    before = tree(root)
    root.chmod(0o777)
    assert remove_retired_spill_dirs(root, 0) == [] and tree(root) == before
    root.chmod(0o700)
    (tmp_path / "link").symlink_to(root)
    assert remove_retired_spill_dirs(tmp_path / "link", 0) == [] and tree(root) == before
    me = os.geteuid()
    monkeypatch.setattr(spill_dirs.os, "geteuid", lambda: me + 1)
    assert remove_retired_spill_dirs(root, 0) == [] and tree(root) == before
    monkeypatch.undo()
    assert remove_retired_spill_dirs(root, 0) == ["1"] and os.listdir(root) == []

