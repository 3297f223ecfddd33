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


# review 23c G1 (fuzz seed 77): tenant B's r4 outgrows a 10-block pool once its sentences are
# demoted (charged to the pool, no host tier); tenant A's r5 arrives 3 steps later.
_R4 = [63, 180, 480, 272, 29, 425, 432, 396, 499, 207, 385, 299, 485, 311, 272, 127, 113, 294, 242, 207, 378, 71,
       394, 412, 197, 7, 485, 18, 27, 254, 324, 21, 382, 184, 390, 222, 61, 132, 259, 464, 289, 353, 251, 29, 334,
       242, 422, 355, 336, 49, 76, 153, 272, 48, 9, 432, 249, 469, 181, 473, 418, 385, 213, 295, 1, 32, 407, 247, 75,
       390, 425, 388, 464, 14, 359, 5, 123, 46, 342, 474, 239, 59, 443, 200, 499, 244, 53, 453, 438, 70, 123, 134,
       108, 396, 429, 45, 83, 85, 77, 13, 495, 330, 220, 98, 258, 257, 181, 402, 330, 110, 131, 182, 408, 116, 481,
       81, 177, 344, 75, 426, 136, 270]
_R5 = [167, 102, 124, 99, 422, 482, 59, 150, 244, 488, 286, 314, 122, 75, 285, 323, 339, 257, 2, 436, 144, 15, 428,
       491, 255, 89, 406, 417, 98, 260, 428, 199, 94, 170, 165, 61, 45, 283, 399, 134, 274, 241, 105, 116, 99, 37, 42,
       433, 413, 442, 278, 183, 243, 251, 469, 196, 458, 87, 198, 199, 445, 284, 220, 314, 385, 134, 13, 496, 305,
       157, 485, 146, 225, 262, 446, 227, 349]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_request_outgrowing_the_pool_beside_another_is_cut_short_not_ping_ponged(tiny: LoadedModel,
                                                                                   scheduler: str) -> None:
    """Regression (review 23c, G1): under fcfs and priority, r4 (needing its next slot, the pool
    full of its own demoted sentences) preempted r5, then itself; both were readmitted and did
    it again: 249 preemptions each in 2,000 steps and r5, another tenant's, never got a token.
    Alone r4 is cut short at 1 token in 10 steps. Now, left alone by its preemptions, it takes
    the alone path: cut short, and r5 finishes."""
    cfg = EngineConfig(block_size=16, kv_pool_bytes=10 * _block_bytes(tiny), max_num_batched_tokens=16,
                       max_num_seqs=4, scheduling_policy=scheduler)
    eng = LLMEngine(tiny.model, cfg, tiny.model_id, tiny.eos_token_ids)
    eng.add_request(_R4, SamplingParams(max_tokens=10, ignore_eos=True), request_id="r4", tenant="B",
                    cache_namespace="B", policy="sentencekv")
    done = {}
    for step in range(200):
        if step == 3:
            eng.add_request(_R5, SamplingParams(max_tokens=19, ignore_eos=True), request_id="r5", tenant="A",
                            cache_namespace="A", policy="sentencekv")
        done |= {o.request_id: o for o in eng.step() if o.finished}
        eng.check_integrity()
        if step >= 3 and not eng.has_unfinished_requests():
            break
    assert set(done) == {"r4", "r5"}, {s.request_id: s.num_preemptions for s in eng.requests.values()}
    assert done["r4"].policy_stats.get("cut_short") == 1.0
    assert len(done["r5"].output_token_ids) == 19 and done["r5"].finish_reason == "length"
