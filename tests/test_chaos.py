"""The heavy reliability scenarios of issue 18 ("Fault tests to add") on a real local stack:
real ``SIGKILL``s of actor processes, disk faults injected inside the spill node, a soak.
Marked ``chaos``: ``make chaos`` runs them, ``make test`` does not. Each scenario is the one
``python -m bench.chaos`` runs (bench/chaos_kills.py, bench/chaos_scheduler.py, bench/chaos_load.py),
asserted here."""

from __future__ import annotations

import pytest

from bench.chaos_kills import kill_cache_node, kill_gateway, spill_faults
from bench.chaos_load import soak
from bench.chaos_scheduler import REFUSAL_LIMIT_S, kill_scheduler
from bench.chaos_stack import ChaosStack, chaos_config

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


@pytest.fixture(scope="module")
def chaos_node(ray_cluster):
    """One more Ray node offering the stack's resources (``chaos_cache_node`` x2,
    ``chaos_spill_node``), so the stacks never compete with other deployments on the cluster."""
    node = ray_cluster.add_node(num_cpus=0, resources={"chaos_cache_node": 2, "chaos_spill_node": 1})
    ray_cluster.wait_for_nodes()
    yield
    ray_cluster.remove_node(node)


@pytest.fixture
def chaos_stack(chaos_node, request, tmp_path):
    """A fresh stack per test (as bench.chaos runs each scenario): what one scenario leaves
    behind does not fail the next."""
    config = chaos_config(str(tmp_path), "chaos_", namespace=f"kvstrata-chaos-{request.node.name}"[:60])
    stack = ChaosStack.start(config)
    yield stack
    stack.stop()


def _no_leaks(fig: dict) -> None:
    nodes = {"cache_node_0", "cache_node_1"}
    assert fig["leaked_blocks"] == dict.fromkeys(nodes, 0), fig
    assert fig["integrity_ok"], fig
    assert fig["scheduler_in_flight"] == dict.fromkeys(nodes, 0), fig


def test_soak_mixed_requests_fail_only_by_design_and_leak_nothing(chaos_stack) -> None:
    """issue 18 soak: sessions, aborts, every registered policy, two tenants: the only failures
    are the requests designed to fail, and every node's blocks are free once idle."""
    fig = soak(chaos_stack, 200)
    assert fig["requests"] >= 200
    assert fig["failed_unexpected"] == 0, fig["unexpected_examples"]
    assert fig["codes"]["INVALID_ARGUMENT"] == fig["by_kind"]["bad_policy"] == 20
    assert fig["codes"].get("UNAUTHENTICATED", 0) + fig["codes"].get("RESOURCE_EXHAUSTED", 0) == 20
    assert fig["by_kind"]["bad_key"] == 20
    assert fig["leaked_blocks"] == {"cache_node_0": 0, "cache_node_1": 0}
    assert fig["integrity_ok"] and fig["sessions_left"] == 0
    assert fig["not_free_after_flush"] == {"cache_node_0": 0, "cache_node_1": 0}


def test_spill_disk_faults_and_a_killed_spill_node_lose_no_request_and_no_file(chaos_stack) -> None:
    """issue 18 (fault 5): EIO on every spill read and ENOSPC on every write inside the spill
    node's process, then SIGKILL of it: requests fall back to recompute (none fails), no spill
    file present before goes missing or shrinks, the node restarts and re-indexes its disk."""
    fig = spill_faults(chaos_stack, prompts=24)
    assert fig["spill_disk_hits_clean"] > 0, fig  # the disk tier was really in use
    assert fig["injected_eio_reads"] > 0 and fig["injected_enospc_writes"] > 0, fig
    assert fig["failed_unexpected"] == 0, fig["failed_codes"]
    assert fig["files_lost_to_transient_faults"] == fig["files_lost_after_restart"] == 0, fig
    assert fig["restarted"] and fig["spill_blocks_disk_after_restart"] >= fig["spill_blocks_disk_before"], fig
    _no_leaks(fig)


def test_kill9_gateway_fails_in_flight_calls_fast_and_keeps_tenants_keys_usage(chaos_stack) -> None:
    """issue 18 (gateway kill; open fault of the reliability suite: scheduler slots leaked
    when the gateway died): SIGKILL of the gateway with streams in flight: they end UNAVAILABLE
    within 2 s; the nodes abort the dead gateway's streams (idle within 5 s, not after
    generating their 400 tokens for nobody); Ray restarts the gateway on the same port by
    itself; tenants, keys and usage are intact and nothing the dead gateway admitted stays
    counted (blocks or scheduler slots)."""
    fig = kill_gateway(chaos_stack)
    assert fig["in_flight_codes"] == ["UNAVAILABLE"], fig
    assert fig["streams_ended_s"] <= 2.0, fig
    assert fig["restarted"] and fig["time_to_recover_s"] is not None, fig
    assert fig["nodes_idle_s"] is not None and fig["nodes_idle_s"] <= 5.0, fig
    assert fig["tenants_intact"] and fig["usage_survived"], fig
    assert fig["keys_work"] == {"chaos-a": "OK", "chaos-b": "OK"}
    _no_leaks(fig)


def test_kill9_cache_node_under_load_fails_fast_retries_succeed_node_rejoins(chaos_stack) -> None:
    """issue 18 (fault 4): SIGKILL of a cache node's worker mid-stream under load: its streams
    end UNAVAILABLE within 2 s, retrying clients succeed on the other node, Ray restarts the
    node and it serves again, tenants and keys intact, every block accounted for."""
    fig = kill_cache_node(chaos_stack, max_tokens=200)
    assert fig["ended_unavailable"] >= 1 and fig["ended_otherwise_on_victim"] == [], fig
    assert fig["streams_ended_s"] <= 2.0, fig
    assert fig["failed_unexpected"] == 0 and "cache_node_1" in fig["retried_ok_nodes"], fig
    assert fig["restarted"] and fig["time_to_recover_s"] is not None, fig
    assert fig["tenants_intact"] and fig["keys_work"] == {"chaos-a": "OK", "chaos-b": "OK"}, fig
    _no_leaks(fig)


def test_kill9_scheduler_under_load_refuses_with_a_hint_and_comes_back_whole(chaos_stack) -> None:
    """The scheduler's restart (docs/architecture.md, 'Failure handling': Scheduler gone and back) under load:
    SIGKILL of the GlobalScheduler with streams running, clients sending new requests and
    session turns, and a tenant whose key the gateway first sees during the outage. Every call
    ends OK or UNAVAILABLE with ``retry-after-ms`` (a key check reaching the restarting
    scheduler had no hint before ``grpc_call_gate._refuse_unreachable``), the running streams
    finish, retries succeed once the gateway serves again, sessions go on on their node with
    their KV, tenants, keys and stored usage survive, and nothing stays counted."""
    fig = kill_scheduler(chaos_stack)
    assert fig["scheduler_restarted"] and fig["time_to_recover_s"] is not None, fig
    assert fig["calls_undefined"] == 0 and fig["unavailable_without_hint"] == 0, fig["undefined_examples"]
    assert fig["retry_hints_ms"] == [1000] and fig["unavailable_before_kill"] == 0, fig
    assert fig["time_to_detect_s"] is not None and fig["slowest_refusal_s"] <= REFUSAL_LIMIT_S, fig
    assert fig["streams_running_at_kill"] == fig["streams_finished"] == 4, fig
    assert fig["retries_failed"] == 0 and fig["late_key_calls"].get("OK", 0) >= 1, fig
    assert fig["sessions_continue"] and fig["tenants_intact"] and fig["usage_not_back"], fig
    assert fig["keys_work"] == {"chaos-a": "OK", "chaos-b": "OK"}
    _no_leaks(fig)
