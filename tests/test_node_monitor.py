"""The gateway's ``NodeMonitor`` against a scheduler and nodes it only calls (no Ray)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.global_scheduler import GlobalScheduler
from services.node_monitor import NodeMonitor
from tests.known_tenants import know_tenants


def _remote(fn: Any) -> SimpleNamespace:
    async def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return SimpleNamespace(remote=call)


class _Node:
    """A node that answers its health poll healthy, from the process it was described with."""

    def __init__(self) -> None:
        self.health = _remote(lambda wait_s: {"healthy": True, "failure": "", "pid": 41, "restarts": 0,
                                              "data_address": "tcp://127.0.0.1:9"})


class _Streams:
    def __init__(self) -> None:
        self.reconnected: list[str] = []

    def reconnect(self, node_id: str, address: str) -> None:
        self.reconnected.append(node_id)

    def fail_node(self, node_id: str, reason: str) -> None:
        raise AssertionError("the node never went down here")


def test_a_node_the_scheduler_holds_down_rejoins_from_a_monitor_that_never_saw_it_go(tmp_path) -> None:
    """Regression (diff review): a gateway that reported a node down and died before its
    ``node_up`` came back taking the node for healthy (its ``describe()``), so no monitor ever
    reported it up again: the scheduler kept it out of routing for good, and every turn of its
    sessions was refused ``session_node_down``. Now a monitor starts from the scheduler's
    view and reports the node up at its first healthy answer; its sessions go on there."""
    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    sched = know_tenants(GlobalScheduler(str(tmp_path), {"n0": 4, "n1": 4}), "t1")
    assert sched.admit("t1", "t1/a", session_id="t1/s").node_id == "n0"  # its session lives on n0
    sched.release("t1/a", finished)
    sched.node_down("n0", "did not answer within 15 s")  # the dead gateway's last word
    assert sched.admit("t1", "t1/b", session_id="t1/s").reason == "session_node_down"
    scheduler = SimpleNamespace(down_nodes=_remote(sched.down_nodes), node_up=_remote(sched.node_up),
                                node_down=_remote(sched.node_down))
    streams = _Streams()
    healthy: list[int] = []

    async def run() -> None:
        monitor = NodeMonitor({"n0": _Node()}, {"n0": {"pid": 41, "restarts": 0}}, streams, scheduler,
                              on_change=healthy.append, poll_s=0.05, timeout_s=1.0, retry_s=0.01)
        monitor.start()
        for _ in range(200):
            if not sched.down:
                break
            await asyncio.sleep(0.01)
        monitor.stop()

    asyncio.run(run())
    assert not sched.down and streams.reconnected == ["n0"] and healthy[-1] == 1
    back = sched.admit("t1", "t1/c", session_id="t1/s")
    assert (back.code, back.continues_session) == ("OK", True)  # the same process: history there
