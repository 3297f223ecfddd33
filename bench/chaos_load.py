"""Client load for bench.chaos: streaming calls that record where they ran and how they ended,
the mixed soak, and the fuzz runs (RPCs and the data plane).

Every call carries a deadline, so a hang shows as DEADLINE_EXCEEDED, never as a stuck run.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.chaos_fuzz import (
    DEFINED_CODES,
    FUZZ_NAMED,
    FUZZ_TENANT,
    auth_metadata,
    call_rpc,
    garbage_frames,
    generate_requests,
    message_strategy,
    rpc_methods,
    send_garbage,
)
from bench.chaos_stack import ChaosStack, gen_request, wait_idle
from kvstrata.v1 import inference_pb2

WORDS = ["cache", "block", "tier", "spill", "node", "tenant", "gateway", "token", "prefix", "session", "policy", "window", "budget", "eviction", "quota", "admission", "stream", "decode", "prefill", "latency", "ray", "actor"]


@dataclass
class CallResult:
    """One streaming call: final status name, the node that served it ("" before started),
    completion tokens, the monotonic times it started and ended, the prompt tokens whose KV was
    reused (every tier, from its ``finished`` event) and the ``retry-after-ms`` trailer of a
    refusal (None without one)."""

    code: str
    node_id: str = ""
    tokens: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    message: str = ""
    cached_tokens: int = 0
    retry_after_ms: int | None = None


def stream(stack: ChaosStack, tenant: str, request: Any, timeout_s: float = 60.0,
           on_started: Any = None, cancel_after_tokens: int = 0) -> CallResult:
    """Run one Generate to its end (or cancel it after ``cancel_after_tokens`` tokens)."""
    res = CallResult("OK", t_start=time.monotonic())
    call = stack.inference.Generate(request, metadata=stack.md(tenant), timeout=timeout_s)
    try:
        for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "started":
                res.node_id = msg.started.node_id
                if on_started is not None:
                    on_started(res)
            elif kind == "delta":
                res.tokens += len(msg.delta.token_ids)
                if cancel_after_tokens and res.tokens >= cancel_after_tokens:
                    call.cancel()
                    res.code = "CANCELLED_BY_CLIENT"
                    break
            elif kind == "finished":
                tiers = msg.finished.cached_tokens
                res.cached_tokens = tiers.device + tiers.host + tiers.spill_ram + tiers.spill_disk
    except grpc.RpcError as exc:
        res.code, res.message = exc.code().name, exc.details() or ""
        hint = dict(exc.trailing_metadata() or ()).get("retry-after-ms")
        res.retry_after_ms = int(hint) if hint is not None and hint.isdigit() else None
    res.t_end = time.monotonic()
    return res


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def with_retries(stack: ChaosStack, tenant: str, request: Any, attempts: int = 8,
                 backoff_s: float = 0.3, **kw: Any) -> list[CallResult]:
    """Call until OK or a non-UNAVAILABLE status (at most ``attempts``); every attempt's result."""
    results = []
    for _ in range(attempts):
        results.append(stream(stack, tenant, request, **kw))
        if results[-1].code != "UNAVAILABLE":
            break
        time.sleep(backoff_s)
    return results


# ---- soak ----------------------------------------------------------------------------------
@dataclass
class SoakTally:
    requests: int = 0
    by_kind: Counter = field(default_factory=Counter)
    codes: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, code: str, expected: set[str], detail: str = "") -> None:
        with self.lock:
            self.requests += 1
            self.by_kind[kind] += 1
            self.codes[code] += 1
            if code not in expected and len(self.unexpected) < 20:
                self.unexpected.append(f"{kind}: {code} {detail[:200]}")
            elif code not in expected:
                self.unexpected.append("")


def _soak_one(stack: ChaosStack, i: int, policies: list[str], tally: SoakTally, max_tokens: int) -> None:
    rng = random.Random(i)
    tenant = ("chaos-a", "chaos-b")[i % 2]
    text = prompt(random.Random(i % 40), 30) + " " + prompt(rng, rng.randint(5, 60))
    policy = policies[i % len(policies)]
    kind = ("plain", "session", "abort", "plain", "bad_policy", "plain", "plain", "bad_key", "plain", "plain")[i % 10]
    if kind == "session":
        sid = f"soak-{i}"
        for turn in range(rng.randint(2, 3)):
            res = stream(stack, tenant, gen_request(f"turn {turn}: {text}", max_tokens, session_id=sid))
            tally.add(kind, res.code, {"OK"}, res.message)
        try:
            stack.inference.CloseSession(inference_pb2.CloseSessionRequest(session_id=sid), metadata=stack.md(tenant),
                                         timeout=30)
            tally.add("close_session", "OK", {"OK"})
        except grpc.RpcError as exc:
            tally.add("close_session", exc.code().name, {"OK"}, exc.details() or "")
    elif kind == "abort":
        res = stream(stack, tenant, gen_request(text, 64, policy=policy), cancel_after_tokens=1)
        tally.add(kind, res.code, {"CANCELLED_BY_CLIENT"}, res.message)
    elif kind == "bad_policy":  # designed to fail
        res = stream(stack, tenant, gen_request(text, max_tokens, policy="no-such-policy"))
        tally.add(kind, res.code, {"INVALID_ARGUMENT"}, res.message)
    elif kind == "bad_key":  # designed to fail (RESOURCE_EXHAUSTED: the gateway's failed-key limit)
        refused = {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}
        call = stack.inference.Generate(gen_request(text, max_tokens), metadata=(("authorization", "Bearer nope"),),
                                        timeout=30)
        try:
            list(call)
            tally.add(kind, "OK", refused)
        except grpc.RpcError as exc:
            tally.add(kind, exc.code().name, refused, exc.details() or "")
    else:
        res = stream(stack, tenant, gen_request(text, max_tokens, policy=policy))
        tally.add(kind, res.code, {"OK"}, res.message)


def soak(stack: ChaosStack, n: int, max_tokens: int = 4, workers: int = 6, progress: Any = None) -> dict[str, Any]:
    """``n`` mixed requests (plain with every registered policy in turn, multi-turn sessions
    closed at the end, aborts, and two kinds designed to fail), two tenants, ``workers`` at once;
    then every node's blocks once idle, and after a Flush."""
    from cache_node.policies import known_policies

    policies = ["", *known_policies()]
    tally = SoakTally()
    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(_soak_one, stack, i, policies, tally, max_tokens) for i in range(n)]
        for done, fut in enumerate(futures, 1):
            fut.result()
            if progress is not None and done % 50 == 0:
                progress(done)
    elapsed = time.monotonic() - t0
    idle = wait_idle(stack)
    stats = stack.stats()
    sessions_left = stats.sessions
    from kvstrata.v1 import admin_pb2

    stack.admin.Flush(admin_pb2.FlushRequest(), metadata=stack.admin_md(), timeout=60)
    flushed = {n.node_id: n.num_blocks - n.free_blocks for n in stack.stats().nodes}
    return {
        "requests": tally.requests, "by_kind": dict(tally.by_kind), "codes": dict(tally.codes),
        "failed_unexpected": len(tally.unexpected), "unexpected_examples": [u for u in tally.unexpected if u][:10],
        "failed_designed": tally.by_kind["bad_policy"] + tally.by_kind["bad_key"] + tally.by_kind["abort"],
        "policies": policies, "elapsed_s": round(elapsed, 1), "requests_per_s": round(tally.requests / elapsed, 1),
        "leaked_blocks": {nid: v["leaked_blocks"] for nid, v in idle.items()},
        "integrity_ok": all(v["integrity_ok"] for v in idle.values()),
        "sessions_left": sessions_left, "not_free_after_flush": flushed,
    }


# ---- fuzz ----------------------------------------------------------------------------------
def fuzz_rpcs(stack: ChaosStack, examples: int, vocab_size: int) -> dict[str, Any]:
    """Hypothesis messages for every RPC: ``examples`` per RPC with valid credentials (the
    admin key or the ``FUZZ_TENANT``'s key; never for ``Rotate*``, which would lock this run
    out of its own keys), then ``examples // 4`` per RPC with none or garbage credentials
    (after all valid ones: the gateway rate-limits an address's failed keys). Returns per
    method the status codes, and every undefined one (UNKNOWN, INTERNAL, UNAVAILABLE, a
    deadline) with its input."""
    for name in (FUZZ_TENANT, FUZZ_NAMED):
        if name not in stack.keys:
            stack.keys[name] = stack.register(name)
    keys = {"tenant": stack.keys[FUZZ_TENANT], "admin": stack.services.admin_key}
    per_method: dict[str, Counter] = {m.path: Counter() for m in rpc_methods()}
    undefined: list[dict[str, Any]] = []
    for valid in (True, False):
        for method in rpc_methods():
            if valid and method.name.startswith("Rotate"):
                continue
            requests = message_strategy(method.request_cls)
            if method.name == "Generate":
                requests = st.one_of(requests, generate_requests(vocab_size))
            auth = auth_metadata(keys if valid else {})
            n = examples if valid else max(2, examples // 4)
            per_method[method.path] += _fuzz_method(stack, method, requests, auth, n, undefined)
    return {
        "calls": sum(sum(c.values()) for c in per_method.values()),
        "codes": {m: dict(c) for m, c in per_method.items()},
        "undefined": sum(c[k] for c in per_method.values() for k in c if k not in DEFINED_CODES),
        "undefined_examples": undefined,
    }


def _fuzz_method(stack: ChaosStack, method: Any, requests: Any, auth: Any, examples: int,
                 undefined: list[dict[str, Any]]) -> Counter:
    codes: Counter = Counter()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(request=requests, auth=auth)
    def run(request: Any, auth: Any) -> None:
        code = call_rpc(stack.channel, method, request, auth[1])
        codes[code] += 1
        if code not in DEFINED_CODES and len(undefined) < 20:
            undefined.append({"rpc": method.path, "auth": auth[0], "code": code, "request": str(request)[:300]})

    run()
    return codes


def data_plane_addresses(stack: ChaosStack) -> dict[str, tuple[str, int, str, str]]:
    """Every data-plane socket a peer could reach: name -> (address, ZeroMQ socket type, the
    role that serves it, a role whose keys it accepts; ``services.data_plane_auth``)."""
    import zmq

    svc = stack.services
    out = {}
    for nid, node in svc.nodes.items():
        out[f"{nid}.commands"] = (ray.get(node.describe.remote(), timeout=30)["data_address"], zmq.PULL,
                                  "node", "gateway")
    out["scheduler.admissions"] = (ray.get(svc.scheduler.open_data_plane.remote(), timeout=30), zmq.ROUTER,
                                   "scheduler", "gateway")
    gw = ray.get(svc.gateway.__ray_call__.remote(lambda g: g.streams.subscriber), timeout=30)
    out["gateway.events"] = (gw, zmq.PULL, "gateway", "node")
    return out


def fuzz_data_plane(stack: ChaosStack, messages: int, seed: int = 0) -> dict[str, Any]:
    """``messages`` garbage ZeroMQ messages and 8 raw TCP payloads into every data-plane socket:
    first without keys (every handshake must be refused: ``refused``), then with the keys of a
    role the socket accepts (the deployment's own processes are untrusted input too)."""
    rng = random.Random(seed)
    frames_strategy = garbage_frames()
    batch: list[list[bytes]] = []

    @settings(max_examples=messages, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(frames=frames_strategy)
    def collect(frames: list[bytes]) -> None:
        batch.append(frames)

    collect()
    raw = [rng.randbytes(rng.randint(1, 4096)) for _ in range(8)]
    sent: dict[str, int] = {}
    errors: dict[str, str] = {}
    keys = stack.services.data_plane_keys
    refused: dict[str, bool] = {}
    for name, (address, kind, server, client) in data_plane_addresses(stack).items():
        refused[name] = not send_garbage(address, kind, batch[:1], [])
        node_id = next(iter(keys.node_clients), "") if keys is not None and client == "node" else ""
        secure = None if keys is None else (  # a node sends with its own key (data_plane_auth)
            lambda s, c=client, r=server, n=node_id: keys.security(c, node_id=n).connect_to(s, r))
        try:
            send_garbage(address, kind, batch, raw, secure)
            sent[name] = len(batch) + len(raw)
        except OSError as exc:  # a refused raw connection is a defined answer, not a fault
            sent[name] = len(batch)
            errors[name] = str(exc)
    return {"sockets": sorted(sent), "messages_per_socket": len(batch), "raw_payloads_per_socket": len(raw),
            "connect_errors": errors, "refused_without_keys": refused}
