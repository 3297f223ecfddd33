"""bench.chaos's crash scenarios: kill -9 a cache node, break and kill the spill node, kill -9
the gateway (Ray restarts it). Each returns its figures as a dict (see bench/chaos.py).

Times are monotonic seconds from the ``SIGKILL``: ``time_to_detect_s`` until the first client
call on the victim ends UNAVAILABLE, ``streams_ended_s`` until the last one does,
``time_to_recover_s`` until the victim serves again.
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.chaos_faults import clear_disk_faults, dir_snapshot, inject_disk_faults
from bench.chaos_load import CallResult, prompt, stream, with_retries
from bench.chaos_stack import ChaosStack, gen_request, kill9, wait_idle, wait_new_pid
from cache_node.tiers.spill_format import FILE_SUFFIX

RESTART_TIMEOUT_S = 60.0


def leak_figures(stack: ChaosStack) -> dict[str, Any]:
    try:
        idle = wait_idle(stack)
    except grpc.RpcError as exc:  # a fault the figures must show, not a crashed scenario
        return {"leaked_blocks": {}, "integrity_ok": False, "stats_error": f"{exc.code().name}: {exc.details()}"[:300]}
    in_flight = ray.get(stack.services.scheduler.stats.remote(), timeout=30).get("in_flight", {})
    return {
        "leaked_blocks": {nid: v["leaked_blocks"] for nid, v in idle.items()},
        "integrity_ok": all(v["integrity_ok"] for v in idle.values()),
        "scheduler_in_flight": in_flight,
    }


def keys_work(stack: ChaosStack) -> dict[str, str]:
    return {t: stream(stack, t, gen_request(f"still {t}?", 2), timeout_s=30).code for t in ("chaos-a", "chaos-b")}


def _load(stack: ChaosStack, clients: int, max_tokens: int, started: dict[str, int]) -> list[Any]:
    """``clients`` threads, each one long stream retried on UNAVAILABLE; ``started`` counts the
    streams started per node. Returns the futures of each client's attempts."""
    lock = threading.Lock()

    def on_started(res: CallResult) -> None:
        with lock:
            started[res.node_id] = started.get(res.node_id, 0) + 1

    def client(i: int) -> list[CallResult]:
        text = f"client {i}: " + prompt(random.Random(i), 40)
        return with_retries(stack, ("chaos-a", "chaos-b")[i % 2], gen_request(text, max_tokens),
                            on_started=on_started, timeout_s=120)

    pool = ThreadPoolExecutor(clients)
    futures = [pool.submit(client, i) for i in range(clients)]
    pool.shutdown(wait=False)
    return futures


def wait_for(cond: Any, timeout_s: float, step_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step_s)
    return False


def _serves_on(stack: ChaosStack, node_id: str, timeout_s: float) -> float | None:
    """Monotonic time a request first ran on ``node_id`` (rounds of 6 concurrent short requests)."""
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(6) as pool:
        while time.monotonic() < deadline:
            results = list(pool.map(lambda i: stream(stack, "chaos-a", gen_request(f"back? {i}", 24), 20), range(6)))
            hits = [r.t_end for r in results if r.code == "OK" and r.node_id == node_id]
            if hits:
                return min(hits)
            time.sleep(0.2)
    return None


def kill_cache_node(stack: ChaosStack, victim: str = "cache_node_0", clients: int = 8,
                    max_tokens: int = 300) -> dict[str, Any]:
    """Scenario a: SIGKILL ``victim``'s worker while ``clients`` streams run on both nodes."""
    handle = stack.services.nodes[victim]
    tenants_before = stack.tenant_names()
    started: dict[str, int] = {}
    futures = _load(stack, clients, max_tokens, started)
    wait_for(lambda: started.get(victim, 0) >= 2 and len(started) == 2, 30)
    time.sleep(0.3)
    pid = kill9(handle)
    t_kill = time.monotonic()
    attempts = [f.result(timeout=300) for f in futures]
    on_victim = [a for client in attempts for a in client if a.node_id == victim and a.t_end > t_kill]
    unavailable = [a.t_end - t_kill for a in on_victim if a.code == "UNAVAILABLE"]
    final = [client[-1] for client in attempts]
    new_pid = wait_new_pid(handle, pid, RESTART_TIMEOUT_S)
    t_back = _serves_on(stack, victim, 60) if new_pid else None
    return {
        "requests": sum(len(c) for c in attempts), "kills": 1, "faults_injected": 1,
        "streams_on_victim_at_kill": len(on_victim),
        "ended_unavailable": len(unavailable),
        "ended_otherwise_on_victim": sorted({a.code for a in on_victim if a.code != "UNAVAILABLE"}),
        "time_to_detect_s": round(min(unavailable), 3) if unavailable else None,
        "streams_ended_s": round(max(unavailable), 3) if unavailable else None,
        "retried_ok": sum(1 for c in attempts if len(c) > 1 and c[-1].code == "OK"),
        "retried_ok_nodes": sorted({c[-1].node_id for c in attempts if len(c) > 1 and c[-1].code == "OK"}),
        "failed_expected": len(unavailable),
        "failed_unexpected": sum(1 for r in final if r.code != "OK"),
        "final_codes": sorted({r.code for r in final}),
        "restarted": new_pid is not None,
        "time_to_recover_s": round(t_back - t_kill, 3) if t_back else None,
        "tenants_intact": stack.tenant_names() == tenants_before,
        "keys_work": keys_work(stack),
        **leak_figures(stack),
    }


def _spill(stack: ChaosStack) -> Any:
    return stack.services.spill_nodes[0]


def _spill_stats(stack: ChaosStack) -> dict[str, int]:
    return ray.get(_spill(stack).stats.remote(), timeout=30)


def _spill_root(stack: ChaosStack) -> str:
    cfg = stack.services.config
    return os.path.abspath(os.path.join(cfg.spill_dir or os.path.join(cfg.state_path, "spill"), "0"))


def _run_prompts(stack: ChaosStack, texts: list[str], max_tokens: int = 2) -> list[CallResult]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda t: stream(stack, "chaos-a", gen_request(t, max_tokens), 60), texts))


def spill_faults(stack: ChaosStack, prompts: int = 40) -> dict[str, Any]:
    """Scenario b: fill the spill disk, then (1) EIO on reads and ENOSPC on writes inside the
    spill node, (2) SIGKILL it (Ray restarts it and it re-indexes its directory); requests run
    throughout. Nothing may fail, and no file present before a fault may go missing or shrink."""
    rng = random.Random(7)
    texts = [f"doc {i}: " + prompt(rng, 180) for i in range(prompts)]
    root = _spill_root(stack)
    warm = _run_prompts(stack, texts)
    wait_for(lambda: _spill_stats(stack)["blocks_spill_disk"] > 0, 10, 0.2)
    # committed group files only: a ``.tmp-*.part`` is a write in progress, renamed or gone later
    before_files = {n: size for n, size in dir_snapshot(root).items() if n.endswith(FILE_SUFFIX)}
    stats_before = _spill_stats(stack)
    clean_hits = _run_prompts(stack, texts[: prompts // 4])
    hits_clean = _spill_stats(stack)["hits_spill_disk"] - stats_before["hits_spill_disk"]

    ray.get(_spill(stack).__ray_call__.remote(inject_disk_faults, root), timeout=30)
    during = _run_prompts(stack, texts[prompts // 4:] + [f"new {i}: " + prompt(rng, 180) for i in range(prompts // 2)])
    injected = ray.get(_spill(stack).__ray_call__.remote(clear_disk_faults), timeout=30)
    stats_faulted = _spill_stats(stack)
    after_fault_files = dir_snapshot(root)

    pid = kill9(_spill(stack))
    t_kill = time.monotonic()
    while_dead = _run_prompts(stack, texts[:8])
    new_pid = wait_new_pid(_spill(stack), pid, RESTART_TIMEOUT_S)
    ok = new_pid is not None and wait_for(lambda: _try_stats(stack) is not None, 60, 0.5)
    t_back = time.monotonic() if ok else None
    after_restart = _run_prompts(stack, texts)
    stats_after = _try_stats(stack) or {}
    final_files = dir_snapshot(root)
    results = warm + clean_hits + during + while_dead + after_restart
    lost = {name: size for name, size in before_files.items() if after_fault_files.get(name, -1) < size}
    lost_restart = {name: size for name, size in before_files.items() if final_files.get(name, -1) < size}
    return {
        "requests": len(results), "kills": 1,
        "faults_injected": injected["read"] + injected["write"] + 1, "injected_eio_reads": injected["read"],
        "injected_enospc_writes": injected["write"],
        "failed_unexpected": sum(1 for r in results if r.code != "OK"),
        "failed_codes": sorted({r.code for r in results if r.code != "OK"}),
        "spill_files_before": len(before_files), "spill_bytes_before": sum(before_files.values()),
        "spill_disk_hits_clean": hits_clean,
        "files_lost_to_transient_faults": len(lost), "files_lost_after_restart": len(lost_restart),
        "lost_files": {n: [before_files[n], after_fault_files.get(n), final_files.get(n)] for n in {**lost, **lost_restart}},
        "files_quarantined": {n: size for n, size in final_files.items() if n not in before_files and "quarantine" in n},
        "spill_bytes_after": sum(final_files.values()),
        "spill_io_errors": stats_faulted.get("io_errors"), "spill_io_retries": stats_faulted.get("io_retries"),
        "spill_disk_hits_during_faults": stats_faulted["hits_spill_disk"] - stats_before["hits_spill_disk"] - hits_clean,
        "spill_blocks_disk_before": stats_before["blocks_spill_disk"],
        "spill_blocks_disk_after_restart": stats_after.get("blocks_spill_disk"),
        "restarted": new_pid is not None,
        "time_to_recover_s": round(t_back - t_kill, 3) if t_back else None,
        **leak_figures(stack),
    }


def _try_stats(stack: ChaosStack) -> dict[str, int] | None:
    """The spill node's stats once it serves again; None while it restarts, or lives but does not
    serve yet (``SpillNode.status``: it waits for its directory or its ``/metrics`` port, and its
    ``stats`` answer then too, with ``serving`` 0: not "back after restart")."""
    try:
        node = _spill(stack)
        if ray.get(node.status.remote(), timeout=5).get("serving") is not True:
            return None
        return ray.get(node.stats.remote(), timeout=5)
    except Exception:  # noqa: BLE001 - still restarting
        return None


def _nodes_idle_at(stack: ChaosStack, timeout_s: float) -> float | None:
    """Monotonic time no cache node runs or queues a request (asked directly, not through the
    gateway); None after ``timeout_s``."""
    nodes = list(stack.services.nodes.values())

    def idle() -> bool:
        return all(s["running"] == s["waiting"] == 0 for s in ray.get([n.stats.remote() for n in nodes], timeout=10))

    return time.monotonic() if wait_for(idle, timeout_s, 0.1) else None


def gateway_serves_again(stack: ChaosStack, old_pid: int, timeout_s: float = RESTART_TIMEOUT_S) -> bool:
    """Wait until Ray restarted the gateway (a new worker process) and its gRPC port answers
    health SERVING again (``services.gateway_server.RayGateway`` rebinds the same port by
    itself); then the stack's channel is renewed. False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if wait_new_pid(stack.services.gateway, old_pid, timeout_s) is None:
        return False
    while time.monotonic() < deadline:
        with grpc.insecure_channel(stack.address) as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    stack.reconnect()
                    return True
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    return False


def kill_gateway(stack: ChaosStack, clients: int = 6, max_tokens: int = 400) -> dict[str, Any]:
    """Scenario c: SIGKILL the gateway with streams in flight; Ray restarts it and it serves
    on the same port again. Tenants, keys and usage must survive, the in-flight calls fail
    fast, and nothing the dead gateway admitted stays counted (blocks or scheduler slots)."""
    tenants_before = stack.tenant_names()
    for t in ("chaos-a", "chaos-b"):  # usage to keep
        for i in range(2):
            stream(stack, t, gen_request(f"usage {i}", 4), 30)
    usage_before = {t: stack.usage(t).requests for t in ("chaos-a", "chaos-b")}
    started: dict[str, int] = {}
    lock = threading.Lock()

    def on_started(res: CallResult) -> None:
        with lock:
            started[res.node_id] = started.get(res.node_id, 0) + 1

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(stream, stack, ("chaos-a", "chaos-b")[i % 2], gen_request(f"long {i}", max_tokens),
                               120, on_started) for i in range(clients)]
        wait_for(lambda: sum(started.values()) >= clients, 30)
        pid = kill9(stack.services.gateway)
        t_kill = time.monotonic()
        in_flight = [f.result() for f in futures]
        idle = pool.submit(_nodes_idle_at, stack, 60.0)  # while Ray restarts the gateway
        failed_after = [r.t_end - t_kill for r in in_flight if r.code != "OK"]
        back = gateway_serves_again(stack, pid)
        t_back = time.monotonic()
        t_idle = idle.result()
    after = {t: stack.usage(t).requests for t in ("chaos-a", "chaos-b")}
    return {
        "requests": len(in_flight), "kills": 1, "faults_injected": 1,
        "in_flight_codes": sorted({r.code for r in in_flight}),
        "failed_expected": sum(1 for r in in_flight if r.code == "UNAVAILABLE"),
        "failed_unexpected": sum(1 for r in in_flight if r.code not in ("UNAVAILABLE", "OK")),
        "time_to_detect_s": round(min(failed_after), 3) if failed_after else None,
        "streams_ended_s": round(max(failed_after), 3) if failed_after else None,
        "nodes_idle_s": round(t_idle - t_kill, 3) if t_idle else None,
        "restarted": back,
        "time_to_recover_s": round(t_back - t_kill, 3) if back else None,
        "tenants_intact": stack.tenant_names() == tenants_before,
        "keys_work": keys_work(stack),
        "usage_requests_before": usage_before, "usage_requests_after": after,
        "usage_survived": all(after[t] >= usage_before[t] > 0 for t in after),
        **leak_figures(stack),
    }
