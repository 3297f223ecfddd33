"""bench.chaos's scheduler scenario: kill -9 the GlobalScheduler under load. Ray restarts it
(``scheduler_max_restarts``), it rebuilds its state from the nodes' reports
(``services.global_scheduler_recovery``) and the gateway serves again (docs/architecture.md,
'Failure handling': Scheduler gone and back).

The load, from before the kill until a call of each client succeeds after the recovery:

- long streams, started before the kill and never retried: they run on their nodes, which do
  not need the scheduler, and must finish OK with every token;
- clients sending new requests one after another, retrying UNAVAILABLE;
- one client per tenant taking turns in a session opened before the kill, retrying UNAVAILABLE;
- from the kill on, a client of a third tenant registered before it, whose key the gateway has
  not checked yet: its key check needs the scheduler.

Times are monotonic seconds from the ``SIGKILL``: ``time_to_detect_s`` until the first call
ends UNAVAILABLE, ``not_serving_s`` / ``serving_s`` until the gateway's health says
NOT_SERVING / SERVING again, ``time_to_recover_s`` until, after that, a new request ends OK.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.chaos_kills import RESTART_TIMEOUT_S, keys_work, leak_figures, wait_for
from bench.chaos_load import CallResult, prompt, stream, with_retries
from bench.chaos_stack import ChaosStack, actor_pid, gen_request, kill9
from kvstrata.v1 import inference_pb2
from services.global_scheduler_admission import USAGE_FLUSH_S

TENANTS = ("chaos-a", "chaos-b")
LATE_TENANT = "chaos-late"
CALL_TIMEOUT_S = 60.0
"""Every call's deadline: a call the outage holds up ends DEADLINE_EXCEEDED, never hangs the run."""
RETRY_PAUSE_S = 0.25
"""A client's pause after an UNAVAILABLE (shorter than the 1 s hint: more calls see the outage)."""
MAX_CALLS_PER_CLIENT = 400
REFUSAL_LIMIT_S = 5.0
"""The longest a refusal may take (no hang). Admissions are refused at once; a call whose key
check reaches the restarting scheduler (a key not checked in the last 10 s) fails when Ray says
the actor is unavailable, 1-2 s on a quiet machine."""
IN_FLIGHT_TIMEOUT_S = 30.0


@dataclass
class _Load:
    """The clients' futures and what the scenario waits for before the kill."""

    stop: threading.Event = field(default_factory=threading.Event)
    streams: list[Future] = field(default_factory=list)
    loops: list[Future] = field(default_factory=list)
    started: int = 0  # long streams started on a node
    ok: Counter = field(default_factory=Counter)  # looping client -> its OK calls
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_started(self, _res: CallResult) -> None:
        with self.lock:
            self.started += 1

    def on_ok(self, client: int) -> None:
        with self.lock:
            self.ok[client] += 1

    def ready(self) -> bool:
        """Every long stream runs on a node and every looping client had an OK call."""
        return self.started >= len(self.streams) and len(self.ok) >= len(self.loops)


def _looping(stack: ChaosStack, tenant: str, request_of: Callable[[int], Any], load: _Load, client: int,
             pause_s: float) -> list[CallResult]:
    """Calls one after another (``pause_s`` after an OK, ``RETRY_PAUSE_S`` after an
    UNAVAILABLE) until one is OK after ``load.stop``; any other status ends the client (a
    failure its last call shows), as does ``MAX_CALLS_PER_CLIENT``."""
    results: list[CallResult] = []
    while len(results) < MAX_CALLS_PER_CLIENT:
        res = stream(stack, tenant, request_of(len(results)), CALL_TIMEOUT_S)
        results.append(res)
        if res.code == "OK":
            load.on_ok(client)
            if load.stop.is_set():
                break
        elif res.code != "UNAVAILABLE":
            break
        time.sleep(pause_s if res.code == "OK" else RETRY_PAUSE_S)
    return results


def _fresh_requests(name: str) -> Callable[[int], Any]:
    """A client's k-th new request: 20 random words after its name, 8 tokens."""
    rng = random.Random(name)
    return lambda k: gen_request(f"{name} call {k}: " + prompt(rng, 20), 8)


def _start_load(stack: ChaosStack, pool: ThreadPoolExecutor, streams: int, clients: int, max_tokens: int,
                sessions: dict[str, str]) -> _Load:
    """``streams`` long streams, ``clients`` clients of new requests and one session client per
    tenant in ``sessions`` (tenant -> session id), on both tenants."""
    load = _Load()
    for i in range(streams):
        text = f"long {i}: " + prompt(random.Random(i), 30)
        load.streams.append(pool.submit(stream, stack, TENANTS[i % 2], gen_request(text, max_tokens), 120,
                                        load.on_started))
    for i in range(clients):
        load.loops.append(pool.submit(_looping, stack, TENANTS[i % 2], _fresh_requests(f"client {i}"), load, i, 0.05))
    for j, (tenant, sid) in enumerate(sessions.items(), clients):
        def turn(k: int, sid: str = sid) -> Any:
            return gen_request(f"turn {k}: and then?", 4, session_id=sid)
        load.loops.append(pool.submit(_looping, stack, tenant, turn, load, j, 0.5))
    return load


def _health(stack: ChaosStack) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(stack.channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
    except grpc.RpcError:
        return None


def _serving_again(stack: ChaosStack, old_pid: int, timeout_s: float) -> tuple[float | None, float | None]:
    """Monotonic times the gateway's health first answered NOT_SERVING after the kill, and then
    SERVING again (after NOT_SERVING, or once the scheduler runs in a new process); None for
    what did not happen within ``timeout_s``."""
    t_down = None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, now = _health(stack), time.monotonic()
        if status == health_pb2.HealthCheckResponse.NOT_SERVING and t_down is None:
            t_down = now
        elif status == health_pb2.HealthCheckResponse.SERVING and (
                t_down is not None or actor_pid(stack.services.scheduler) not in (None, old_pid)):
            return t_down, now
        time.sleep(0.05)
    return t_down, None


def _stored_usage(stack: ChaosStack) -> dict[str, int]:
    """Each tenant's usage requests once the scheduler's periodic flush has stored them (no
    request ends meanwhile): what a crash may not take back."""
    for t in TENANTS:
        stream(stack, t, gen_request(f"usage of {t}", 4), 30)
    time.sleep(USAGE_FLUSH_S + 1.0)
    return {t: stack.usage(t).requests for t in TENANTS}


def _scheduler_record(stack: ChaosStack) -> tuple[int | None, int]:
    """The scheduler actor's (pid while ALIVE, restarts) from Ray's GCS actor table."""
    from ray._private import state

    record = state.actors(actor_id=stack.services.scheduler._actor_id.hex()) or {}
    return actor_pid(stack.services.scheduler), int(record.get("NumRestarts", 0))


def _in_flight_zero_at(stack: ChaosStack, timeout_s: float) -> float | None:
    def zero() -> bool:
        stats = ray.get(stack.services.scheduler.stats.remote(), timeout=10)
        return not any(stats.get("in_flight", {}).values())
    return time.monotonic() if wait_for(zero, timeout_s, 0.25) else None


def _call_figures(calls: list[CallResult], t_kill: float, t_back: float | None) -> dict[str, Any]:
    """Every client call: its codes, those that ended during the outage (kill to recovery),
    the refusals (after the kill, with a hint, how long they took) and those with any other
    status (none may be)."""
    refused = [c for c in calls if c.code == "UNAVAILABLE"]
    undefined = [c for c in calls if c.code not in ("OK", "UNAVAILABLE")]
    after = [c.t_end - t_kill for c in refused if c.t_end >= t_kill]
    return {
        "calls": len(calls), "codes": dict(Counter(c.code for c in calls)),
        "calls_ended_in_outage": sum(1 for c in calls if t_kill <= c.t_end <= (t_back or float("inf"))),
        "unavailable": len(refused), "unavailable_before_kill": sum(1 for c in refused if c.t_end < t_kill),
        "unavailable_without_hint": sum(1 for c in refused if not c.retry_after_ms),
        "retry_hints_ms": sorted({c.retry_after_ms for c in refused if c.retry_after_ms}),
        "unavailable_messages": sorted({c.message for c in refused})[:5],
        "slowest_refusal_s": round(max((c.t_end - c.t_start for c in refused), default=0.0), 3),
        "calls_undefined": len(undefined),
        "undefined_examples": [f"{c.code}: {c.message[:200]}" for c in undefined[:5]],
        "time_to_detect_s": round(min(after), 3) if after else None,
        "last_refusal_s": round(max(after), 3) if after else None,
    }


def _session_figures(stack: ChaosStack, opened: dict[str, CallResult], loops: list[list[CallResult]],
                     sessions: dict[str, str]) -> dict[str, Any]:
    """Per tenant: the node its session opened on, every node an OK turn ran on, a last turn
    now (its node and cached tokens: its history's KV, kept on that node), then its close
    (the status and the tokens it freed: its blocks must not count as leaked)."""
    out: dict[str, Any] = {}
    session_loops = loops[-len(sessions):]
    for (tenant, sid), turns in zip(sessions.items(), session_loops, strict=True):
        last = stream(stack, tenant, gen_request("one more turn", 4, session_id=sid), 60)
        out[tenant] = {
            "opened_on": opened[tenant].node_id, "turns_ok": sum(1 for t in turns if t.code == "OK"),
            "turn_nodes": sorted({t.node_id for t in turns if t.code == "OK"}),
            "last_code": last.code, "last_node": last.node_id, "last_cached_tokens": last.cached_tokens,
            **_close(stack, tenant, sid),
        }
    return out


def _close(stack: ChaosStack, tenant: str, sid: str) -> dict[str, Any]:
    try:
        freed = stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id=sid),
                                             metadata=stack.md(tenant), timeout=30).freed_tokens
        return {"close_code": "OK", "freed_tokens": freed}
    except grpc.RpcError as exc:
        return {"close_code": exc.code().name, "freed_tokens": 0}


def _sessions_continue(sessions: dict[str, Any]) -> bool:
    return all(s["last_code"] == "OK" and s["last_node"] == s["opened_on"] and s["last_cached_tokens"] > 0
               and s["turn_nodes"] == [s["opened_on"]] for s in sessions.values())


@dataclass
class _Outage:
    """What the clients saw around the kill: monotonic times (``t_down``/``t_serving``: health
    NOT_SERVING and SERVING again; ``t_back``: the first OK request after that) and every call."""

    pid: int
    t_kill: float
    t_down: float | None
    t_serving: float | None
    t_back: float | None
    long: list[CallResult]
    loops: list[list[CallResult]]  # the clients of new requests, then the session clients
    late: list[CallResult]
    probe: list[CallResult]


def _kill_under_load(stack: ChaosStack, streams: int, clients: int, max_tokens: int,
                     sessions: dict[str, str]) -> _Outage:
    """Start the load, kill -9 the scheduler once it runs, start the late key's client, wait
    for the gateway to serve again and a request to succeed, then let every client finish."""
    with ThreadPoolExecutor(streams + clients + len(sessions) + 1) as pool:
        load = _start_load(stack, pool, streams, clients, max_tokens, sessions)
        wait_for(load.ready, 60)
        pid = kill9(stack.services.scheduler)
        t_kill = time.monotonic()
        late = pool.submit(_looping, stack, LATE_TENANT, _fresh_requests(LATE_TENANT), load, -1, 0.05)
        t_down, t_serving = _serving_again(stack, pid, RESTART_TIMEOUT_S)
        probe = with_retries(stack, TENANTS[0], gen_request("back?", 4), attempts=40, backoff_s=RETRY_PAUSE_S,
                             timeout_s=CALL_TIMEOUT_S) if t_serving else []
        t_back = probe[-1].t_end if probe and probe[-1].code == "OK" else None
        load.stop.set()
        return _Outage(pid, t_kill, t_down, t_serving, t_back, [f.result(timeout=300) for f in load.streams],
                       [f.result(timeout=300) for f in load.loops], late.result(timeout=300), probe)


def _since(t: float | None, t_kill: float) -> float | None:
    return round(t - t_kill, 3) if t is not None else None


def kill_scheduler(stack: ChaosStack, streams: int = 4, clients: int = 4, max_tokens: int = 256) -> dict[str, Any]:
    """Scenario f: SIGKILL the GlobalScheduler's process under load (see the module docstring).
    Every call ends OK or UNAVAILABLE with a retry hint; the running streams finish; Ray
    restarts the scheduler and the gateway serves again; tenants, keys, sessions and stored
    usage survive; nothing stays counted (blocks on the nodes, requests at the scheduler)."""
    stack.keys[LATE_TENANT] = stack.register(LATE_TENANT)
    tenants_before = stack.tenant_names()
    sessions = {t: f"kept-{t}" for t in TENANTS}
    opened = {t: stream(stack, t, gen_request(f"open {t}: " + prompt(random.Random(t), 30), 4, session_id=sid), 60)
              for t, sid in sessions.items()}
    usage_before = _stored_usage(stack)
    _, restarts = _scheduler_record(stack)
    out = _kill_under_load(stack, streams, clients, max_tokens, sessions)
    new_pid, restarts_after = _scheduler_record(stack)
    clients_calls = [*out.loops, out.late]
    calls = _call_figures([*out.long, *[c for client in clients_calls for c in client], *out.probe], out.t_kill,
                          out.t_back)
    session_figs = _session_figures(stack, opened, out.loops, sessions)
    usage_after = {t: stack.usage(t).requests for t in TENANTS}
    t_idle = _in_flight_zero_at(stack, IN_FLIGHT_TIMEOUT_S)
    retries_failed = sum(1 for client in clients_calls if client[-1].code != "OK")
    keys = keys_work(stack)
    return {
        "requests": calls["calls"] + len(opened) + len(usage_before) + len(session_figs) + len(keys), "kills": 1,
        "faults_injected": 1, "streams_running_at_kill": sum(1 for s in out.long if s.t_end > out.t_kill),
        "stream_codes": sorted({s.code for s in out.long}), "stream_tokens": [s.tokens for s in out.long],
        "streams_finished": sum(1 for s in out.long if s.code == "OK" and s.tokens == max_tokens),
        "looping_clients": len(clients_calls), "retries_failed": retries_failed,
        "final_codes": sorted({client[-1].code for client in clients_calls}),
        "late_key_calls": dict(Counter(c.code for c in out.late)),
        **calls,
        "failed_expected": calls["unavailable"] - calls["unavailable_without_hint"],
        "failed_unexpected": calls["calls_undefined"] + calls["unavailable_without_hint"] + retries_failed,
        "not_serving_s": _since(out.t_down, out.t_kill), "serving_s": _since(out.t_serving, out.t_kill),
        "time_to_recover_s": _since(out.t_back, out.t_kill),
        "scheduler_restarted": new_pid not in (None, out.pid) and restarts_after == restarts + 1,
        "scheduler_pids": [out.pid, new_pid], "scheduler_restarts": restarts_after,
        "sessions": session_figs, "sessions_continue": _sessions_continue(session_figs),
        "tenants_intact": stack.tenant_names() == tenants_before, "keys_work": keys,
        "usage_requests_before": usage_before, "usage_requests_after": usage_after,
        "usage_not_back": all(usage_after[t] >= usage_before[t] > 0 for t in TENANTS),
        "in_flight_zero_s": _since(t_idle, out.t_kill),
        **leak_figures(stack),
    }
