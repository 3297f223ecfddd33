"""The reliability suite against a real local cluster: kills, disk faults, fuzz, soak.

``python -m bench.chaos [--quick] [--soak N] [--only NAME...]``. On one local Ray cluster
(2 CPUs), each scenario gets a fresh stack (GlobalScheduler, two cache nodes, a spill node with
disk only, the gateway; its own state dir and Ray namespace) on a tiny random Llama with
SmolLM2's tokenizer (``bench.chaos_stack``), so a fault one scenario leaves behind does not
count against the next. In order:

a. ``kill_cache_node``: ``SIGKILL`` of a cache node's worker under 8 streaming clients;
   streams on it must end UNAVAILABLE within 2 s, retrying clients succeed on the other node,
   Ray restarts the node and it serves again, tenants and keys intact;
b. ``spill_faults``: EIO/ENOSPC injected at the OS-call level inside the spill node
   (``bench.chaos_faults``; the machine runs as root, so a read-only directory stops nothing),
   then a ``SIGKILL`` of it: no request fails, no spill file present before goes missing;
c. ``kill_gateway``: ``SIGKILL`` of the gateway with streams in flight; Ray restarts it on the
   same port: in-flight calls fail fast with UNAVAILABLE; tenants, keys, usage survive; the
   dead gateway's streams are aborted on the nodes and its scheduler slots released;
f. ``kill_scheduler``: ``SIGKILL`` of the GlobalScheduler under streams, new requests and
   session turns (``bench.chaos_scheduler``); Ray restarts it and it rebuilds from the nodes'
   reports: every call ends OK or UNAVAILABLE with a retry hint, running streams finish,
   retries succeed once the gateway serves again, tenants, keys, sessions (on their node, with
   their KV) and stored usage survive, nothing stays counted;
e. ``soak``: mixed requests (sessions, aborts, every registered policy, two tenants, two
   kinds designed to fail): zero unexpected failures, zero leaked blocks;
d. ``fuzz``: hypothesis messages for every RPC and garbage into every data-plane socket
   (``bench.chaos_fuzz``); then every process must be the one that was there before, and
   both nodes must serve.

Each scenario reports requests, kills, faults injected, failures (expected, unexpected),
leaked blocks per node once idle (``Stats(check_integrity=True)``), and where it applies
time to detect and time to recover (seconds from the kill). Progress goes to stderr with rich;
each scenario's figures print as indented JSON, and the last stdout line is one JSON object
with every figure and ``ok`` (every acceptance check held).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from rich.console import Console

from bench.chaos_kills import kill_cache_node, kill_gateway, spill_faults
from bench.chaos_load import fuzz_data_plane, fuzz_rpcs, soak, stream
from bench.chaos_scheduler import REFUSAL_LIMIT_S, kill_scheduler
from bench.chaos_stack import ChaosStack, actor_pid, chaos_config, gen_request, ray_local, wait_idle

console = Console(stderr=True)
DETECT_LIMIT_S = 2.0


def _no_leaks(fig: dict[str, Any]) -> bool:
    return (all(v == 0 for v in fig.get("leaked_blocks", {}).values()) and fig.get("integrity_ok", True)
            and all(v == 0 for v in fig.get("scheduler_in_flight", {}).values()))


def checks(figures: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Each acceptance check of issue 18's reliability suite (and of the scheduler's restart), by name."""
    a, b, c = figures.get("kill_cache_node", {}), figures.get("spill_faults", {}), figures.get("kill_gateway", {})
    d, e, f = figures.get("fuzz", {}), figures.get("soak", {}), figures.get("kill_scheduler", {})
    out = {}
    if a:
        out |= {
            "a_streams_unavailable_within_2s": a["ended_unavailable"] > 0 and a["streams_ended_s"] <= DETECT_LIMIT_S
            and not a["ended_otherwise_on_victim"],
            "a_retries_succeed": a["failed_unexpected"] == 0,
            "a_node_restarted_and_serves": a["time_to_recover_s"] is not None,
            "a_tenants_keys_intact": a["tenants_intact"] and set(a["keys_work"].values()) == {"OK"},
            "a_no_leaks": _no_leaks(a),
        }
    if b:
        out |= {
            "b_no_failed_requests": b["failed_unexpected"] == 0,
            "b_no_file_lost": b["files_lost_to_transient_faults"] == 0 and b["files_lost_after_restart"] == 0,
            "b_spill_restarted": b["time_to_recover_s"] is not None,
            "b_no_leaks": _no_leaks(b),
        }
    if c:
        out |= {
            "c_in_flight_fail_fast": c["failed_unexpected"] == 0 and c["streams_ended_s"] is not None
            and c["streams_ended_s"] <= DETECT_LIMIT_S,
            "c_state_survives": c["restarted"] and c["tenants_intact"] and c["usage_survived"] and set(c["keys_work"].values()) == {"OK"},
            "c_no_leaks": _no_leaks(c),
        }
    if d:
        out |= {"d_defined_statuses": d["rpc"]["undefined"] == 0, "d_no_process_died": d["processes_unchanged"],
                "d_still_serves": d["serves_after"]}
    if e:
        out |= {"e_no_unexpected_failures": e["failed_unexpected"] == 0,
                "e_no_leaks": all(v == 0 for v in e["leaked_blocks"].values()) and e["integrity_ok"]
                and e["sessions_left"] == 0}
    if f:
        out |= _scheduler_checks(f)
    return out


def _scheduler_checks(f: dict[str, Any]) -> dict[str, bool]:
    return {
        "f_calls_ok_or_unavailable_with_hint": f["calls_undefined"] == 0 and f["unavailable_without_hint"] == 0
        and f["unavailable_before_kill"] == 0 and f["time_to_detect_s"] is not None
        and f["slowest_refusal_s"] <= REFUSAL_LIMIT_S,
        "f_running_streams_finish": f["streams_running_at_kill"] > 0 and f["stream_codes"] == ["OK"]
        and f["streams_finished"] == len(f["stream_tokens"]),
        "f_back_and_retries_succeed": f["scheduler_restarted"] and f["time_to_recover_s"] is not None
        and f["retries_failed"] == 0,
        "f_tenants_keys_intact": f["tenants_intact"] and set(f["keys_work"].values()) == {"OK"},
        "f_session_continues_on_its_node": f["sessions_continue"],
        "f_usage_not_back": f["usage_not_back"],
        "f_no_leaks": all(v == 0 for v in f["leaked_blocks"].values()) and f["integrity_ok"],
        "f_in_flight_back_to_0": bool(f["scheduler_in_flight"]) and not any(f["scheduler_in_flight"].values()),
    }


def _pids(stack: ChaosStack) -> dict[str, int | None]:
    svc = stack.services
    handles = {"gateway": svc.gateway, "scheduler": svc.scheduler, **svc.nodes,
               **{f"spill_node_{i}": h for i, h in enumerate(svc.spill_nodes)}}
    return {name: actor_pid(h) for name, h in handles.items()}


def fuzz(stack: ChaosStack, examples: int, messages: int) -> dict[str, Any]:
    """Scenario d: the RPC fuzz, then the data-plane fuzz; processes and service checked after."""
    before = _pids(stack)
    t0 = time.monotonic()
    rpc = fuzz_rpcs(stack, examples, vocab_size=49152)
    plane = fuzz_data_plane(stack, messages)
    results = [stream(stack, t, gen_request(f"after fuzz {i}", 8), 10) for i, t in enumerate(["chaos-a", "chaos-b"] * 4)]
    idle = wait_idle(stack)
    after = _pids(stack)
    return {
        "requests": rpc["calls"] + len(results), "kills": 0, "faults_injected": rpc["calls"] + sum(
            plane["messages_per_socket"] + plane["raw_payloads_per_socket"] for _ in plane["sockets"]),
        "rpc": rpc, "data_plane": plane, "elapsed_s": round(time.monotonic() - t0, 1),
        "processes_unchanged": before == after, "processes_before": before, "processes_after": after,
        "serves_after": all(r.code == "OK" for r in results), "codes_after": sorted({r.code for r in results}),
        "failed_unexpected": rpc["undefined"] + sum(1 for r in results if r.code != "OK"),
        "leaked_blocks": {nid: v["leaked_blocks"] for nid, v in idle.items()},
        "integrity_ok": all(v["integrity_ok"] for v in idle.values()),
    }


def run(quick: bool, soak_requests: int | None, only: list[str] | None) -> dict[str, Any]:
    """Every scenario on a fresh stack (its own state dir and Ray namespace), so that a fault
    one of them leaves behind does not show up as the next one's failure."""
    ray_local({"cache_node": 2, "spill_node": 1}, namespace="kvstrata-chaos")
    n_soak = soak_requests or (300 if quick else 10_000)
    scenarios = {
        "kill_cache_node": lambda st: kill_cache_node(st, max_tokens=200 if quick else 400),
        "spill_faults": lambda st: spill_faults(st, prompts=24 if quick else 60),
        "kill_gateway": kill_gateway,
        "kill_scheduler": lambda st: kill_scheduler(st, max_tokens=256 if quick else 400),
        "soak": lambda st: soak(st, n_soak, progress=lambda k: console.log(f"soak: {k}/{n_soak}")),
        "fuzz": lambda st: fuzz(st, examples=20 if quick else 150, messages=60 if quick else 500),
    }
    figures: dict[str, Any] = {}
    for name, scenario in scenarios.items():
        if only and name not in only:
            continue
        console.rule(name)
        t = time.monotonic()
        try:
            stack = ChaosStack.start(chaos_config(tempfile.mkdtemp(prefix="kvstrata-chaos-"),
                                                  namespace=f"kvstrata-chaos-{name}"))
            console.log(f"stack up in {time.monotonic() - t:.0f} s at {stack.address}")
        except Exception as exc:  # noqa: BLE001 - reported as the scenario's error
            console.print_exception()
            figures[name] = {"error": f"stack did not start: {type(exc).__name__}: {exc}"[:500]}
            continue
        try:
            figures[name] = scenario(stack)
        except Exception as exc:  # noqa: BLE001 - a scenario that crashes is a figure too
            console.print_exception()
            figures[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        finally:
            stack.stop()
        figures[name]["scenario_s"] = round(time.monotonic() - t, 1)
        print(json.dumps({name: figures[name]}, indent=2, default=str), flush=True)
    return figures


def summary(figures: dict[str, Any], quick: bool, elapsed_s: float) -> dict[str, Any]:
    ran = {k: v for k, v in figures.items() if "error" not in v}
    results = checks(ran)
    return {
        "bench": "chaos", "quick": quick, "elapsed_s": round(elapsed_s, 1),
        "requests": sum(v.get("requests", 0) for v in ran.values()),
        "kills": sum(v.get("kills", 0) for v in ran.values()),
        "faults_injected": sum(v.get("faults_injected", 0) for v in ran.values()),
        "failed_expected": sum(v.get("failed_expected", 0) + v.get("failed_designed", 0) for v in ran.values()),
        "failed_unexpected": sum(v.get("failed_unexpected", 0) for v in ran.values()),
        "blocks_leaked": {k: v.get("leaked_blocks") for k, v in ran.items()},
        "time_to_detect_s": {k: v.get("time_to_detect_s") for k, v in ran.items() if "time_to_detect_s" in v},
        "time_to_recover_s": {k: v.get("time_to_recover_s") for k, v in ran.items() if "time_to_recover_s" in v},
        "errors": {k: v["error"] for k, v in figures.items() if "error" in v},
        "checks": results, "ok": bool(results) and all(results.values()) and len(ran) == len(figures),
        "scenarios": figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few hundred soak requests, small fuzz (minutes)")
    parser.add_argument("--soak", type=int, default=None, help="soak requests (default 300 quick, 10,000 full)")
    parser.add_argument("--only", nargs="*", default=None,
                        help="scenarios to run: kill_cache_node spill_faults kill_gateway kill_scheduler soak fuzz")
    args = parser.parse_args()
    t0 = time.monotonic()
    figures = run(args.quick, args.soak, args.only)
    print(json.dumps(summary(figures, args.quick, time.monotonic() - t0), default=str), flush=True)


if __name__ == "__main__":
    main()
