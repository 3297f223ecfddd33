"""Liveness of preemption under every scheduling policy: requests that preempt each other for
blocks still all finish (cache_node/scheduling/kvstrata.py ``victim``, preemption.py).

Regression (review 22a, F3): under the kvstrata scheduler, on a node without a host tier, a
SentenceKV request in prefill that needed blocks took the other tenant's request that had just
finished its prefill (its demoted sentences are charged to the pool, so it was the most over
its quota), which re-prefilled and took the first one back the same way: 3,978 and 3,972
preemptions in 12,000 steps with 2 and 1 tokens out, and the requests of both tenants queued
behind them were never admitted. fcfs, vtc and priority finished the same ten in ~128 steps.
The workloads are the review's fuzz generator (two tenants, shared prefixes, SentenceKV
variants, aborts, forced demotions); seeds 11, 15 and 23 hung under kvstrata.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore

POLICIES = ["sentencekv-0.25", "sentencekv-0.5", "sentencekv"]
SCHEDULERS = ["kvstrata", "fcfs", "vtc", "priority"]
MAX_STEPS = 1500  # each workload ends in ~60-140 steps; the hang never did


def _block_bytes(lm: LoadedModel) -> int:
    mc = lm.model.config
    head_dim = mc.hidden_size // mc.num_attention_heads
    return 2 * mc.num_hidden_layers * 16 * mc.num_key_value_heads * head_dim * 4  # fp32, 16 tokens


def _workload(lm: LoadedModel, seed: int, scheduler: str, spill_dir: str) -> tuple[LLMEngine, list[dict], random.Random]:
    """The fuzz's requests and engine for ``seed`` (12-24 blocks, no host tier, spill store on
    half the seeds), with ``scheduler``."""
    rng = random.Random(seed)
    shared = [[rng.randrange(1, 500) for _ in range(rng.choice([16, 32, 48, 70]))] for _ in range(4)]
    reqs = []
    for i in range(rng.randrange(6, 14)):
        prompt = rng.choice(shared) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        reqs.append({"id": f"r{i}", "prompt": prompt, "max_tokens": rng.randrange(1, 30),
                     "tenant": rng.choice(["A", "B"]), "policy": rng.choice(POLICIES),
                     "at": rng.randrange(0, 30), "abort": rng.random() < 0.15})
    pool_blocks = rng.choice([12, 16, 24])
    rng.choice([0, 6, 20])  # the fuzz's host tier draw (forced to none)
    spill = rng.random() < 0.5
    cfg = EngineConfig(block_size=16, kv_pool_bytes=pool_blocks * _block_bytes(lm),
                       max_num_batched_tokens=rng.choice([16, 32, 64]), max_num_seqs=8,
                       scheduling_policy=scheduler)
    rng.choice(SCHEDULERS)  # the fuzz's scheduler draw (the parameter decides)
    store = None
    if spill:
        probe = LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids)
        store = SpillStore(Path(spill_dir), BlockFormat(*probe.spill_block_spec()), 8 * _block_bytes(lm), 1 << 30)
    return LLMEngine(lm.model, cfg, lm.model_id, lm.eos_token_ids, spill=store), reqs, rng


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("seed", [11, 15, 23])
def test_sentencekv_tenants_without_a_host_tier_all_finish(tiny: LoadedModel, seed: int, scheduler: str,
                                                          tmp_path: Path) -> None:
    """The workload ends under every scheduler (tmp_path: the spill store's files)."""
    eng, reqs, rng = _workload(tiny, seed, scheduler, str(tmp_path))
    pending = sorted(reqs, key=lambda r: r["at"])
    finished: dict[str, int] = {}
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0]["at"] <= step:
            r = pending.pop(0)
            eng.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                            request_id=r["id"], cache_namespace=r["tenant"], tenant=r["tenant"],
                            policy=r["policy"])
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.num_preemptions
        if rng.random() < 0.1:
            eng.demote_all(to_spill=rng.random() < 0.5)
        for r in reqs:
            if r["abort"] and r["id"] in eng.requests and step == r["at"] + 3:
                eng.abort_request(r["id"])
        eng.check_integrity()
        step += 1
        assert step <= MAX_STEPS, (
            f"still running after {MAX_STEPS} steps: " + str({s.request_id: (len(s.output_token_ids), s.num_preemptions)
                                                           for s in eng.requests.values() if not s.is_finished}))
    assert set(finished) == {r["id"] for r in reqs}
    eng.wait_for_transfers()
