"""What the service layer costs: the same workload in-process vs. through gRPC + Ray.

``python -m bench.service [--quick]``. Both paths run one cache node with the same config and
the same Wikipedia chat prompts (as token ids, so templating is identical):

* in-process: ``services.cache_node.CacheNode.generate`` called directly;
* service: a local Ray cluster with the GlobalScheduler, one CacheNode actor and the Gateway
  actor, driven by a grpc.aio client with a real tenant and API key;
* http: the same gateway's OpenAI-compatible API (``services.openai_api``), driven by the
  official ``openai`` client (``AsyncOpenAI``, streamed ``/v1/completions`` of the token ids), in
  its own cache partition (``cache_salt``) so its prompts are as cold as the other paths'.

Both run side by side in one process and are measured alternately (see ``_rounds``), so load
from elsewhere on the machine hits both. TTFT is the first streamed token, client side, one
request at a time on a cold cache; throughput has all requests in flight at once.

Each request's TTFT splits into the node's own TTFT (``ttft_ms`` of its ``finished`` event: from
the engine's ``add_request`` to the first token) and the time outside the engine (client TTFT
minus that), which is where the service path adds its cost: gRPC, the gateway, admission, the
data plane. On 2 shared cores a cold prefill of the same prompt varies by ~10% from run to run
(σ ~80 ms in back-to-back runs on one node), so an end-to-end paired difference resolves tens of
milliseconds, not single ones; the A/A control below measures that floor in the same run.

- ``added_ttft_ms_p50``: median over prompts of (service - in-process) time outside the engine,
  the two runs of the same prompt back to back; ``added_ttft_ms_p50_probe`` the same for a
  16-token cached prompt;
- ``node_ttft_ms_p50``: the node's own TTFT on both paths (the engine is not slower behind the
  service when these agree);
- ``added_ttft_ms_p50_end_to_end``: median over prompts of the (service - in-process) client TTFT;
  ``aa_ttft_ms_p50_end_to_end`` the same between two in-process runs (A/A: zero but for noise);
- ``throughput_ratio`` = median over rounds of service / in-process tokens/s;
- ``http``: the HTTP path's ``ttft_ms_p50``, ``added_ttft_ms_p50`` (outside the engine, against
  in-process, paired as gRPC's), ``added_ttft_ms_p50_end_to_end``, ``added_ttft_ms_p50_probe``
  and ``added_ttft_ms_p50_probe_end_to_end``, measured in the same rounds next to gRPC's (TTFT
  and probes only; throughput is gRPC's).

Last stdout line: JSON with ``ttft_ms_p50`` (both paths), ``added_ttft_ms_p50`` and
``throughput_ratio`` (service / in-process), and the figures above.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# The in-process peer runs with the environment the launcher gives cache node workers.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import openai
import ray

from bench.common import median, wiki_chat_requests
from cache_node.model_loader import load_model
from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services.cache_node import CacheNode
from services.config import NodeConfig, ServiceConfig
from services.grpc_messages import client_channel_options
from services.launcher import start_services, stop_services
from services.node_request import NodeRequest
from services.ray_auth import init_local_cluster
from services.tls import ClientTls, http_scheme, open_aio_channel
from workloads.corpus import load_corpus
from workloads.deepresearch.openai_client import openai_http_client

ORDERS = list(itertools.permutations(("in_process", "service", "in_process_aa")))


async def _inproc_one(
    node: CacheNode, ns: str, rid: str, ids: list[int], max_tokens: int
) -> tuple[float, int, float]:
    """(client TTFT ms, generated tokens, the node's own TTFT ms)."""
    req = NodeRequest(
        request_id=rid,
        tenant="bench",
        cache_namespace=ns,
        token_ids=tuple(ids),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time_s=time.monotonic(),
    )
    t0, ttft, n, node_ttft = time.perf_counter(), 0.0, 0, 0.0
    async for ev in node.generate(req):
        if ev["type"] == "delta":
            ttft = ttft or (time.perf_counter() - t0) * 1000
            n += len(ev["token_ids"])
        elif ev["type"] == "finished":
            node_ttft = ev["ttft_ms"]
    return ttft, n, node_ttft


async def _grpc_one(stub, md, rid: str, ids: list[int], max_tokens: int) -> tuple[float, int, float]:
    """(client TTFT ms, generated tokens, the node's own TTFT ms)."""
    req = inference_pb2.GenerateRequest(
        tokens=inference_pb2.TokenIds(ids=ids),
        request_id=rid,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    t0, ttft, n, node_ttft = time.perf_counter(), 0.0, 0, 0.0
    async for msg in stub.Generate(req, metadata=md):
        kind = msg.WhichOneof("event")
        if kind == "delta":
            ttft = ttft or (time.perf_counter() - t0) * 1000
            n += len(msg.delta.token_ids)
        elif kind == "finished":
            node_ttft = msg.finished.ttft_ms
    return ttft, n, node_ttft


async def _http_one(client: openai.AsyncOpenAI, model: str, rid: str, ids: list[int],
                    max_tokens: int) -> tuple[float, int, float]:
    """(client TTFT ms, generated tokens, the node's own TTFT ms) through the OpenAI API.

    The ids ride in ``extra_body``, which the client sends as they are: its typed ``prompt``
    walks a token-id list element by element first (``openai._utils.maybe_transform``: 12 ms
    for 470 ids here, 0.7 ms for 16), a cost of the client library, not of the HTTP path."""
    t0, ttft, n, node_ttft = time.perf_counter(), 0.0, 0, 0.0
    stream = await client.completions.create(
        model=model, prompt="", max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": "http", "prompt": ids})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            ttft = ttft or (time.perf_counter() - t0) * 1000
        if chunk.usage is not None:
            n, node_ttft = chunk.usage.completion_tokens, chunk.model_extra["kvstrata"]["ttft_ms"]
    return ttft, n, node_ttft


async def _throughput(one, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    """All prompts in flight at once on one path; generated tokens per second."""
    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(f"{tag}-b{i}", p, max_tokens) for i, p in enumerate(prompts)))
    return sum(n for _, n, _ in done) / (time.perf_counter() - t0)


async def _rounds(
    node: CacheNode,
    address: str,
    http_address: str,
    admin_key: str,
    prompts: list[list[int]],
    max_tokens: int,
    rounds: int,
    probes: int,
    tls: ClientTls | None = None,
) -> dict[str, Any]:
    """Measure both paths in alternating order so machine noise hits both alike (both APIs of
    the gateway over TLS with ``tls``: ``ClientTls.of_config`` of the config it was started with).

    Per round ``r`` (round 0 warms up and is not reported), in the cache namespace ``bench-r<r>``
    on both paths (the service path through a tenant registered with that namespace):

    1. TTFT triples: each prompt alone, cold, on the service path, in-process, and in-process
       again in the namespace ``bench-r<r>-aa`` (the A/A control), in each of the 6 orders in
       turn;
    2. throughput: all prompts at once on each path (order flips per round); they find the
       round's prompts cached from step 1, the same way on both paths;
    3. overhead probes: a 16-token prompt and one output token, ``probes`` pairs; after the
       first pair the prompt is a prefix hit on both paths, so the TTFT is one short forward
       pass plus the path's own cost.
    """
    out: dict[str, Any] = {
        "ttft_pairs": [],
        "aa_pairs": [],
        "tps": {"in_process": [], "service": []},
        "probe_pairs": [],
        "http_pairs": [],
        "http_probe_pairs": [],
    }
    http = openai.AsyncOpenAI(base_url=f"{http_scheme(tls)}://{http_address}/v1", api_key="-", max_retries=0,
                              http_client=openai_http_client(tls))
    async with open_aio_channel(address, tls, client_channel_options()) as ch:
        admin = (("authorization", f"Bearer {admin_key}"),)
        tenants = tenant_pb2_grpc.TenantServiceStub(ch)
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        keys = await _round_keys(tenants, admin, rounds)
        probe = prompts[0][:16]
        clients = [http.with_options(api_key=md[0][1].split(" ", 1)[1]) for md in keys]  # per round's tenant
        model = (await clients[0].models.list()).data[0].id
        for r in range(rounds + 1):
            ns = f"bench-r{r}"
            paths = {
                "in_process": lambda rid, p, m, ns=ns: _inproc_one(node, ns, rid, p, m),
                "service": lambda rid, p, m, md=keys[r]: _grpc_one(stub, md, rid, p, m),
                "in_process_aa": lambda rid, p, m, ns=ns: _inproc_one(node, f"{ns}-aa", rid, p, m),
                "http": lambda rid, p, m, c=clients[r]: _http_one(c, model, rid, p, m),
            }
            if r == 0:
                for name, one in paths.items():
                    await one(f"{name}-warm", probe, 2)
                continue
            await _measure_round(paths, r, prompts, probe, max_tokens, probes, out)
            _print_round(r, out, len(prompts))
    return out


async def _round_keys(tenants: Any, admin: tuple[tuple[str, str], ...], rounds: int) -> list[Any]:
    """Register one tenant per round (cache namespace ``bench-r<r>``); their call metadata."""
    keys = []
    for r in range(rounds + 1):
        resp = await tenants.RegisterTenant(
            tenant_pb2.RegisterTenantRequest(
                spec=tenant_pb2.TenantSpec(name=f"bench-r{r}", cache_namespace=f"bench-r{r}")
            ),
            metadata=admin,
        )
        keys.append((("authorization", f"Bearer {resp.api_key}"),))
    return keys


async def _measure_round(paths: dict[str, Any], r: int, prompts: list[list[int]], probe: list[int],
                         max_tokens: int, probes: int, out: dict[str, Any]) -> None:
    """Steps 1-3 of round ``r`` (see ``_rounds``), appending to ``out``."""
    for i, p in enumerate(prompts):
        order = ORDERS[(i + r) % len(ORDERS)]
        ttft = {name: await paths[name](f"{name}-r{r}-t{i}", p, 1) for name in order}
        out["ttft_pairs"].append((ttft["in_process"], ttft["service"]))
        out["aa_pairs"].append((ttft["in_process"], ttft["in_process_aa"]))
        out["http_pairs"].append((ttft["in_process"], await paths["http"](f"http-r{r}-t{i}", p, 1)))
    for name in ("in_process", "service") if r % 2 else ("service", "in_process"):
        out["tps"][name].append(await _throughput(paths[name], prompts, max_tokens, f"{name}-r{r}"))
    for k in range(probes):
        order = ("in_process", "service") if k % 2 else ("service", "in_process")
        ttft = {name: await paths[name](f"{name}-r{r}-p{k}", probe, 1) for name in order}
        out["probe_pairs"].append((ttft["in_process"], ttft["service"]))
        out["http_probe_pairs"].append((ttft["in_process"], await paths["http"](f"http-r{r}-p{k}", probe, 1)))


def _print_round(r: int, out: dict[str, Any], num_prompts: int) -> None:
    pairs = out["ttft_pairs"][-num_prompts:]
    print(
        f"round {r}: TTFT p50 in-process {median([a[0] for a, _ in pairs]):.1f} ms, service "
        f"{median([b[0] for _, b in pairs]):.1f} ms; tok/s in-process {out['tps']['in_process'][-1]:.2f}, "
        f"service {out['tps']['service'][-1]:.2f}; added TTFT per prompt (ms) outside the "
        f"engine {[round(_outside(b) - _outside(a), 1) for a, b in pairs]}, end to end "
        f"{[round(b[0] - a[0]) for a, b in pairs]}",
        flush=True,
    )


Run = tuple[float, int, float]  # (client TTFT ms, generated tokens, the node's own TTFT ms)


def _client(run: Run) -> float:
    return run[0]


def _node(run: Run) -> float:
    return run[2]


def _outside(run: Run) -> float:
    """A request's TTFT outside the engine: client TTFT minus the node's own, in ms."""
    return run[0] - run[2]


def _both(pairs: list[tuple[Run, Run]], f: Any) -> dict[str, float]:
    """Median of ``f`` on each side of ``(in_process, service)`` pairs."""
    return {"in_process": round(median([f(a) for a, _ in pairs]), 2),
            "service": round(median([f(b) for _, b in pairs]), 2)}


def _added(pairs: list[tuple[Run, Run]], f: Any) -> float:
    """Median over pairs of ``f(second) - f(first)``."""
    return round(median([f(b) - f(a) for a, b in pairs]), 2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--rounds", type=int, default=0, help="measured rounds (default 3 quick, 4 full)"
    )
    ap.add_argument("--probes", type=int, default=10, help="overhead probe pairs per round")
    args = ap.parse_args(argv)
    n, max_tokens = (8, 24) if args.quick else (16, 48)
    rounds = args.rounds or (3 if args.quick else 4)
    tok = load_model().tokenizer
    prompts = [list(r.prompt_token_ids) for r in wiki_chat_requests(tok, load_corpus(), n, seed=1)]
    threads = os.cpu_count() or 2
    cfg = NodeConfig(kv_pool_bytes=256 << 20, torch_threads=threads, max_num_seqs=32)
    init_local_cluster(  # token-authenticated: its ports face the network
        namespace="kvstrata-bench",
        include_dashboard=False,
        log_to_driver=False,
        resources={"cache_node": 1},
    )
    # no spill node: the in-process peer has none either (both have the node's host tier)
    services = start_services(
        ServiceConfig(
            num_cache_nodes=1,
            num_spill_nodes=0,
            node=cfg,
            scheduler="fcfs",  # the in-process peer's CacheNode default
            gateway_port=0, http_port=0,
            state_dir=tempfile.mkdtemp(prefix="kvstrata-bench-"),
        )
    )
    node = CacheNode("inproc", cfg, threads)
    try:
        res = asyncio.run(
            _rounds(
                node, services.address, services.http_address, services.admin_key, prompts, max_tokens, rounds,
                args.probes, ClientTls.of_config(services.config),
            )
        )
    finally:
        node.shutdown()
        stop_services(services)
        ray.shutdown()
    print(json.dumps(_summary(res, n, max_tokens, rounds)))


def _summary(res: dict[str, Any], n: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """The run's figures: medians over rounds of what ``_rounds`` measured."""
    pairs, probes, aa = res["ttft_pairs"], res["probe_pairs"], res["aa_pairs"]
    tps = {k: median(v) for k, v in res["tps"].items()}
    ratios = [sv / ip for ip, sv in zip(res["tps"]["in_process"], res["tps"]["service"])]
    return {
        "requests": n,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "ttft_ms_p50": _both(pairs, _client),
        "added_ttft_ms_p50": _added(pairs, _outside),
        "node_ttft_ms_p50": _both(pairs, _node),
        "outside_engine_ttft_ms_p50": _both(pairs, _outside),
        "added_ttft_ms_p50_end_to_end": _added(pairs, _client),
        "aa_ttft_ms_p50_end_to_end": _added(aa, _client),
        "probe_ttft_ms_p50": _both(probes, _client),
        "added_ttft_ms_p50_probe": _added(probes, _outside),
        "added_ttft_ms_p50_probe_end_to_end": _added(probes, _client),
        "tokens_per_s": {k: round(v, 2) for k, v in tps.items()},
        "throughput_ratio": round(median(ratios), 3),
        "throughput_ratio_per_round": [round(x, 3) for x in ratios],
        "http": {
            "ttft_ms_p50": _both(res["http_pairs"], _client)["service"],
            "added_ttft_ms_p50": _added(res["http_pairs"], _outside),
            "added_ttft_ms_p50_end_to_end": _added(res["http_pairs"], _client),
            "added_ttft_ms_p50_probe": _added(res["http_probe_pairs"], _outside),
            "added_ttft_ms_p50_probe_end_to_end": _added(res["http_probe_pairs"], _client),
        },
    }


if __name__ == "__main__":
    main()
