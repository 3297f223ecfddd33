"""``spill_node.await_serving`` against a node that begins serving between its failed ``ready``
and the ``status`` read that follows it (94cc53d).

Regression (s36 clean-clone CI, once): ``await_serving`` asked ``ready``, got ``SpillDirLocked``
(the node's previous process still held its directory), then read ``status``; the node had begun
serving in between, so ``status`` named no holder and no ``previous_process``, and the wait failed
the start as "held by another store" for a node that was serving. The window is a few
milliseconds wide in the wild; here a real ``SpillNode`` actor holds it open: its first failed
``ready`` lets the holder process go and answers only once the node serves, so the ``status``
read after it always sees a serving node.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from cache_node.tiers.spill_lock import SpillDirLocked
from services.spill_node import SpillNode, await_serving
from tests.test_spill_lock_wait import HOLDER, holder_processes
from tests.test_spill_store import DISK, FMT, hashes_of

OWNER = "kvstrata-test/spill-await-race"


class ServesAfterFailedReady(SpillNode):
    """A real spill node waiting for its directory (``holder_pid`` holds it); its first ``ready``
    that fails kills that holder and raises its refusal only once the node serves (within 30 s):
    the race's moment, made certain."""

    def __init__(self, *args: object, holder_pid: int, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.holder_pid, self.failed_readies = holder_pid, 0

    def ready(self) -> bool:
        try:
            return super().ready()
        except SpillDirLocked:
            self.failed_readies += 1
            if self.failed_readies == 1:
                os.kill(self.holder_pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                while not self.status()["serving"] and time.monotonic() < deadline:
                    time.sleep(0.02)
            raise

    def readies_failed(self) -> int:
        return self.failed_readies


@pytest.fixture
def holder() -> Iterator[callable]:  # type: ignore[valid-type]
    yield from holder_processes(HOLDER)


def test_a_node_that_began_serving_after_its_failed_ready_is_waited_for(
        tmp_path: Path, holder, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    """``await_serving`` returns (the node serves; its blocks are there), having asked ``ready``
    again after a ``status`` that said serving. Before 94cc53d it raised RuntimeError "a spill
    node does not serve: ... another store" at once."""
    root = tmp_path / "spill"
    root.mkdir(mode=0o700)
    old = holder(root / "0", OWNER)
    actor = ray.remote(ServesAfterFailedReady).options(max_restarts=0, resources={}, num_cpus=0).remote(
        str(root / "0"), FMT, 0, DISK, node_id="spill-await-race", lock_owner=OWNER, lock_wait_s=0.1,
        holder_pid=old.pid)
    try:
        start = time.monotonic()
        await_serving([actor], timeout_s=30, poll_s=0.1)
        assert time.monotonic() - start < 20
        assert ray.get(actor.readies_failed.remote(), timeout=30) == 1  # the race was run, once
        assert ray.get(actor.status.remote(), timeout=30)["serving"] is True
        assert ray.get(actor.contains.remote(hashes_of([50])), timeout=30) == ["spill_disk"]
    finally:
        ray.kill(actor, no_restart=True)
