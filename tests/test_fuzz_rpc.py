"""Fuzz of the public API over real gRPC and of the data plane over real sockets, on a real
local stack (tiny random Llama, two cache nodes, a spill node): no process dies, every reply
is a defined status, nothing hangs (issue 18, "Fault tests to add": fuzz)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from bench.chaos_fuzz import DEFINED_CODES, rpc_methods
from bench.chaos_load import fuzz_data_plane, fuzz_rpcs, stream
from bench.chaos_stack import ChaosStack, actor_pid, gen_request, stack_on_cluster, wait_idle

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_stack(ray_cluster, tmp_path_factory):
    gen = stack_on_cluster(ray_cluster, "fuzz_", str(tmp_path_factory.mktemp("fuzz-state")))
    yield next(gen)
    gen.close()


def _pids(stack: ChaosStack) -> dict[str, int | None]:
    svc = stack.services
    handles = {"gateway": svc.gateway, "scheduler": svc.scheduler, **svc.nodes,
               **{f"spill_{i}": h for i, h in enumerate(svc.spill_nodes)}}
    return {name: actor_pid(h) for name, h in handles.items()}


def _serves_on_every_node(stack: ChaosStack) -> set[str]:
    """Nodes that served 12 concurrent requests (all must succeed)."""
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda i: stream(stack, "chaos-a", gen_request(f"after the fuzz {i}", 24), 30),
                                range(12)))
    assert [r.code for r in results] == ["OK"] * 12, results
    return {r.node_id for r in results}


def test_every_rpc_answers_fuzzed_messages_with_a_defined_status(fuzz_stack) -> None:
    """issue 18 fuzz: hypothesis messages (all field types, unicode, huge repeated fields) and
    random credentials for every RPC of every service: each reply is a defined status, never
    UNKNOWN / INTERNAL / UNAVAILABLE / DEADLINE_EXCEEDED, and no process dies."""
    before = _pids(fuzz_stack)
    vocab = 49152
    figures = fuzz_rpcs(fuzz_stack, examples=25, vocab_size=vocab)
    assert set(figures["codes"]) == {m.path for m in rpc_methods()}
    assert figures["undefined"] == 0, figures["undefined_examples"]
    assert all(set(c) <= DEFINED_CODES for c in figures["codes"].values())
    assert _pids(fuzz_stack) == before
    assert _serves_on_every_node(fuzz_stack) == set(fuzz_stack.services.nodes)


def test_garbage_into_every_data_plane_socket_kills_nothing(fuzz_stack) -> None:
    """issue 18 fuzz (faults 3, 4): random bytes and wrong-shape msgpack into every ZeroMQ
    socket (node command inboxes, the scheduler's admissions, the gateway's event inbox) and raw
    TCP bytes: every process lives, every node still serves, no block leaks."""
    before = _pids(fuzz_stack)
    figures = fuzz_data_plane(fuzz_stack, messages=60)
    assert len(figures["sockets"]) == len(fuzz_stack.services.nodes) + 2
    assert all(figures["refused_without_keys"].values()), figures  # CURVE: no keys, no connection
    assert _pids(fuzz_stack) == before
    assert _serves_on_every_node(fuzz_stack) == set(fuzz_stack.services.nodes)
    leaks = wait_idle(fuzz_stack)
    assert {nid: (v["leaked_blocks"], v["integrity_ok"]) for nid, v in leaks.items()} == {
        nid: (0, True) for nid in fuzz_stack.services.nodes
    }
    assert ray.get(fuzz_stack.services.scheduler.stats.remote())["in_flight"] == {
        nid: 0 for nid in fuzz_stack.services.nodes
    }
