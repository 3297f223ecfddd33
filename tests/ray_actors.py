"""Actor classes the Ray tests place, in a module that imports only what they run.

A Ray worker imports the module of the class it runs (cloudpickle pickles an importable class
by reference): a class defined in a test module made each actor's process import that whole
test module, torch and transformers' modeling code among it, for a fake that needs none of
them. Measured (one-node local cluster, the shared 2-core host): a ``SpillNode`` subclass from
tests/test_admin_flush_spill_silent.py was ready 5.5-8.7 s after its creation, the same class
from here 1.3-3.5 s; importing tests.test_tier_ray costs 7.5 s of CPU, this module ~0.7 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from typing import Any

import ray

from services.spill_node import SpillNode


class PidSpillNode(SpillNode):
    """A real spill node that names its worker process (a test stops it with SIGSTOP)."""

    def pid(self) -> int:
        return os.getpid()


class SlowSpillNode(SpillNode):
    """A spill node whose reads take 2 s, so a test can kill it mid-read."""

    def get(self, hashes, token_ids=None):  # type: ignore[no-untyped-def]
        time.sleep(2.0)
        return super().get(hashes, token_ids)


class StalledPutNode(SpillNode):
    """A spill node whose first put takes 3 s (a disk stall); counts the puts it runs."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.puts = 0

    def put(self, hashes, blocks, namespace, token_ids=None, weight=1.0):  # type: ignore[no-untyped-def]
        self.puts += 1
        if self.puts == 1:
            time.sleep(3.0)
        return super().put(hashes, blocks, namespace, token_ids, weight)

    def num_puts(self) -> int:
        return self.puts


class CountingSpillNode(SpillNode):
    """A real spill node that counts its ``status`` calls and can hang (stuck disk I/O)."""

    status_calls = 0

    def status(self) -> dict[str, Any]:
        CountingSpillNode.status_calls += 1
        return super().status()

    def calls(self) -> int:
        return CountingSpillNode.status_calls

    def hang(self, time_s: float) -> int:
        """Hangs ``time_s``; returns the ``status`` calls run before it."""
        ran = CountingSpillNode.status_calls
        time.sleep(time_s)
        return ran


@ray.remote(num_cpus=0)
class AnsweringNode:
    """A cache node whose recovery report holds one device block (data plane on port 9100)."""

    def recovery_report(self) -> dict:
        return {"healthy": True, "failure": "", "pid": 5, "restarts": 0, "data_address": "tcp://127.0.0.1:9100",
                "metrics_address": "", "blocks": [(b"\x01" * 32, "device")], "sessions": [], "requests": []}


@ray.remote(num_cpus=0)
class SilentNode:
    """A hung cache node: its recovery report never comes."""

    async def recovery_report(self) -> dict:
        await asyncio.sleep(3600)
        return {}


@ray.remote(num_cpus=0)
class OneBlockSpill:
    """A spill node holding one block in its RAM tier."""

    def held_blocks(self) -> list:
        return [(b"\x03" * 32, "spill_ram")]


@ray.remote(num_cpus=0)
class NameHolder:
    """Another actor holding a name a start is about to take."""

    def ping(self) -> str:
        return "other"


class GatedSpillNode(SpillNode):
    """A real spill node whose block report (``report_held``, or ``held_blocks`` on the code
    before s38) takes its answer, then waits for ``release`` (a slow answer) and counts calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reports, self.taken, self.gate = 0, threading.Event(), threading.Event()

    def _gated(self, answer: Any) -> Any:
        self.reports += 1
        self.taken.set()
        self.gate.wait(30)
        return answer

    def report_held(self) -> Any:
        return self._gated(super().report_held())

    def held_blocks(self) -> Any:
        return self._gated(super().held_blocks())

    def state(self) -> tuple[int, bool]:
        return self.reports, self.taken.is_set()

    def release(self) -> None:
        self.gate.set()

    def hold(self) -> None:
        self.gate.clear()
        self.taken.clear()


@ray.remote(num_cpus=0)
class RecreatingScheduler:
    """A global scheduler whose spill watch creates spill node ``name`` again (detached, as
    ``kvstrata up``'s are) while ``kvstrata down`` asks it to store its counters."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name = namespace, name

    def flush_durable(self) -> None:
        holder = NameHolder.options(name=self.name, namespace=self.namespace, lifetime="detached").remote()
        ray.get(holder.ping.remote())


@ray.remote(num_cpus=0)
class WatchingScheduler:
    """A global scheduler whose spill watch creates spill node ``name`` again (detached, as
    ``services.spill_recreate`` does) whenever no actor holds that name, polling every 10 ms
    from ``watch`` (or ``flush_durable``, which a stop calls) until its process dies."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace, self.name, self.created = namespace, name, 0

    def watch(self) -> None:
        threading.Thread(target=self._recreate, daemon=True).start()

    def flush_durable(self, drain_s: float = 0.0) -> None:
        self.watch()

    def recreated(self) -> int:
        return self.created

    def _recreate(self) -> None:
        while True:
            try:
                ray.get_actor(self.name, namespace=self.namespace)
            except ValueError:  # none alive: created again
                with contextlib.suppress(ValueError):  # the name not released yet
                    NameHolder.options(name=self.name, namespace=self.namespace, lifetime="detached").remote()
                    self.created += 1
            time.sleep(0.01)


@ray.remote(num_cpus=0)
class ServedGateway:
    """A gateway's served-address record, kept as ``RayGateway.start`` keeps it: a real
    ``ServedRecord`` under this actor's own id, in the cluster's GCS."""

    async def serve(self, grpc_address: str) -> str:
        from services.gateway_served import ServedRecord

        gateway_id = ray.get_runtime_context().get_actor_id()
        await ServedRecord(gateway_id).save({"grpc": grpc_address})
        return gateway_id

    def stop(self) -> None:
        pass


@ray.remote(num_cpus=0)
class CountingPeer:
    """A peer that notes every call of ``note`` it runs, and names its worker process (a test
    stops it with SIGSTOP: a peer alive but silent)."""

    def __init__(self) -> None:
        self.notes: list[tuple[Any, ...]] = []

    def note(self, node_id: str, session_ids: list[str]) -> bool:
        self.notes.append((node_id, session_ids))
        return True

    def noted(self) -> list[tuple[Any, ...]]:
        return self.notes

    def pid(self) -> int:
        return os.getpid()
