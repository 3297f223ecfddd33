"""A spill node purges deleted tenants' own namespaces that it missed (``services.spill_sweep``).

Regression: deleting a tenant dropped its own namespace on the spill nodes only through the
cache nodes, once (``end_tenant``). A spill node down, restarting or slow at that moment kept
the tenant's group files, whose headers hold its prompts' token ids, and indexed them again
at its next start. Now each spill node pages through the tenant store's deletions
(``GlobalScheduler.deleted_tenants_after``) at start and every ``sweep_interval_s``.

Real parts: ``GlobalScheduler`` over its SQLite tenant store, ``SpillNode`` over a
``SpillStore`` with real group files.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import services.spill_sweep
import tenants.store
from cache_node.tiers import spill_unserved
from cache_node.tiers.spill_format import QUARANTINE_DIR, read_header
from services.global_scheduler import GlobalScheduler
from services.spill_node import SpillNode
from services.spill_sweep import DeletedTenantSweep
from tenants.model import TenantSpec, own_namespace
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, make_blocks


def _fill(root: Path, namespaces: dict[str, range]) -> None:
    """A spill store at ``root`` holding each namespace's blocks on disk, then closed."""
    store = SpillNode(root, FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK, demote_low_watermark=0)._store
    for namespace, indices in namespaces.items():
        store.put(hashes_of(indices), make_blocks(indices), namespace, [[i] * 4 for i in indices])
    store.demote_to_disk()
    store.close()  # the node goes down: its lock with its process


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_restarted_spill_node_purges_a_tenant_deleted_while_it_was_down(tmp_path: Path) -> None:
    """Before: bob's group file came back into the index at the restart, its token ids on disk."""
    scheduler = GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    bob, _ = scheduler.register_tenant(TenantSpec("bob"))
    ann, _ = scheduler.register_tenant(TenantSpec("ann"))
    root = tmp_path / "spill"
    _fill(root, {own_namespace(bob.tenant_id): range(3), f"{own_namespace(bob.tenant_id)}#salt=s": range(3, 5),
                 own_namespace(ann.tenant_id): range(5, 8)})
    scheduler.delete_tenant("bob")  # while the spill node is down: no cache node reached it

    node = SpillNode(root, FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK,
                     deleted_tenants=scheduler.deleted_tenants_after, sweep_interval_s=3600)
    try:
        _wait(lambda: node.stats()["sweeps"] >= 1)
        assert node.stats()["swept_blocks"] == 5
        assert [read_header(f).namespace for f in files_in(root)] == [own_namespace(ann.tenant_id)]
        assert node.contains(hashes_of(range(8))) == [None] * 5 + ["spill_disk"] * 3
    finally:
        node._sweep.stop()
        scheduler.store.close()


def test_later_deletions_are_swept_and_a_failed_ask_is_retried(tmp_path: Path) -> None:
    scheduler = GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    ids = [scheduler.register_tenant(TenantSpec(f"t{i}"))[0].tenant_id for i in range(3)]
    node = SpillNode(tmp_path / "spill", FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK)
    for i, tenant_id in enumerate(ids):
        node.put(hashes_of([i]), make_blocks([i]), own_namespace(tenant_id), [[i] * 4])
    down = {"yes": True}

    def deleted(seq: int):  # type: ignore[no-untyped-def]
        if down["yes"]:
            raise ConnectionError("scheduler restarting")
        return scheduler.deleted_tenants_after(seq)

    sweep = DeletedTenantSweep(node._store, deleted, node_id="s0")
    scheduler.delete_tenant("t0")
    assert sweep.sweep() == 0 and sweep.counters["sweep_failures"] == 1 and sweep.cursor == 0
    down["yes"] = False
    assert sweep.sweep() == 1 and node.contains(hashes_of(range(3))) == [None, "spill_ram", "spill_ram"]
    assert sweep.sweep() == 0  # nothing new: the cursor moved past t0
    scheduler.delete_tenant("t2")
    assert sweep.sweep() == 1 and node.contains(hashes_of(range(3))) == [None, "spill_ram", None]
    scheduler.store.close()


def test_deletions_are_paged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tenants.store, "DELETED_PAGE", 2)
    monkeypatch.setattr(services.spill_sweep, "DELETED_PAGE", 2)
    scheduler = GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    ids = [scheduler.register_tenant(TenantSpec(f"t{i}"))[0].tenant_id for i in range(5)]
    node = SpillNode(tmp_path / "spill", FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK)
    for i, tenant_id in enumerate(ids):
        node.put(hashes_of([i]), make_blocks([i]), own_namespace(tenant_id), [[i] * 4])
        scheduler.delete_tenant(f"t{i}")
    asked: list[int] = []

    def deleted(seq: int):  # type: ignore[no-untyped-def]
        asked.append(seq)
        return scheduler.store.deleted_tenants_after(seq, 2)

    sweep = DeletedTenantSweep(node._store, deleted)
    assert sweep.sweep() == 5 and len(asked) == 3
    scheduler.store.close()


@pytest.mark.parametrize("answer", [
    "x", None, [[1]], [[1, "a", 2]], [["1", "a"]], [[1, 7]], [[1, "../../x"]], [[1, "a" * 65]],
    [[2, "a"], [1, "b"]], [[0, "a"]], [[1, "a"]] * 4097, [[True, "a"]],
], ids=lambda a: repr(a)[:30])
def test_a_malformed_answer_drops_nothing_and_moves_nothing(tmp_path: Path, answer: object) -> None:
    """Every byte from the network is untrusted, the scheduler's too: a malformed answer is
    counted and ignored; the cursor stays."""
    node = SpillNode(tmp_path / "spill", FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK)
    node.put(hashes_of([0]), make_blocks([0]), own_namespace("a"), [[0] * 4])
    sweep = DeletedTenantSweep(node._store, lambda seq: answer)
    assert sweep.sweep() == 0 and sweep.counters["sweep_bad_answers"] == 1 and sweep.cursor == 0
    assert node.contains(hashes_of([0])) == ["spill_ram"]


def test_the_scheduler_refuses_non_int_arguments(tmp_path: Path) -> None:
    scheduler = GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    with pytest.raises(TypeError):
        scheduler.deleted_tenants_after("0")  # type: ignore[arg-type]
    assert scheduler.deleted_tenants_after(-5, 10**9) == []
    scheduler.store.close()


def test_a_deleted_tenants_late_put_is_refused(tmp_path: Path) -> None:
    """Review 24r F6: blocks of a deleted tenant offloaded after the sweep passed its deletion
    were stored (then demoted to disk with their token ids) and never swept again (the cursor
    was past it). Now a namespace dropped for good refuses later puts."""
    scheduler = GlobalScheduler(str(tmp_path / "state"), {"n0": 1})
    bob, _ = scheduler.register_tenant(TenantSpec("bob"))
    ann, _ = scheduler.register_tenant(TenantSpec("ann"))
    node = SpillNode(tmp_path / "spill", FMT, ram_bytes=64 * BLOCK, disk_bytes=DISK)
    node.put(hashes_of([0]), make_blocks([0]), own_namespace(bob.tenant_id), [[0] * 4])
    scheduler.delete_tenant("bob")
    sweep = DeletedTenantSweep(node._store, scheduler.deleted_tenants_after)
    assert sweep.sweep() == 1
    late = f"{own_namespace(bob.tenant_id)}#salt=s"  # its salted variants too
    assert node.put(hashes_of([1, 2]), make_blocks([1, 2]), late, [[1] * 4, [2] * 4]) == 0
    assert node.put(hashes_of([3]), make_blocks([3]), own_namespace(ann.tenant_id), [[3] * 4]) == 1
    assert node.contains(hashes_of(range(4))) == [None, None, None, "spill_ram"]
    assert node.stats()["put_refused_dropped"] == 2
    scheduler.store.close()


def test_every_sweep_expires_old_quarantined_files_even_when_the_ask_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 26b F5: a quarantined file whose corrupt header names no tenant is kept at most
    ``QUARANTINE_MAX_AGE_S``; an idle node's sweeps delete it past that, whether or not the
    scheduler answers."""
    root = tmp_path / "spill"
    node = SpillNode(root, FMT, ram_bytes=0, disk_bytes=DISK)
    node.put(hashes_of([0, 1]), make_blocks([0, 1]), own_namespace("bob"), [[0] * 4, [1] * 4])
    (path,) = files_in(root)
    path.write_bytes(b"\xff" * 64 + path.read_bytes()[64:])  # its header
    assert node.get(hashes_of([0, 1])).hashes == []
    assert len(list((root / QUARANTINE_DIR).iterdir())) == 1

    def down(seq: int) -> list[tuple[int, str]]:
        raise ConnectionError("scheduler restarting")

    sweep = DeletedTenantSweep(node._store, down)
    sweep.sweep()
    assert len(list((root / QUARANTINE_DIR).iterdir())) == 1  # younger than the limit
    monkeypatch.setattr(spill_unserved, "QUARANTINE_MAX_AGE_S", 0.0)
    sweep.sweep()
    assert list((root / QUARANTINE_DIR).iterdir()) == []
    assert (sweep.counters["sweeps"], sweep.counters["sweep_failures"]) == (2, 2)
    assert node.stats()["removed_quarantined_files"] == 1
