"""Pool accounting under a soak: shared prefixes, aborts mid-prefill/decode, sampling, preemption."""

from __future__ import annotations

import random

from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def test_soak_300_mixed_requests_leaves_every_block_free_or_cached(tiny) -> None:
    rng = random.Random(0)
    # 48 blocks of 16 tokens (8 KiB each on the tiny model): small enough that preemption and LRU eviction both happen
    eng = make_engine(tiny, kv_pool_bytes=48 * 8192, max_num_batched_tokens=96, max_num_seqs=6)
    shared = [[rng.randrange(1, 500) for _ in range(rng.choice([16, 40, 64]))] for _ in range(5)]
    submitted, aborted_prefill, aborted_decode, finished = 0, 0, 0, 0
    live: dict[str, int] = {}
    while submitted < 300 or eng.has_unfinished_requests():
        while submitted < 300 and len(live) < 10:
            prompt = rng.choice(shared) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 60))]
            temp = rng.choice([0.0, 0.8])
            sp = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=temp, top_p=0.9,
                                seed=submitted)
            rid = eng.add_request(prompt, sp, cache_namespace=rng.choice(["a", "b"]))
            live[rid] = rng.choice([0, 0, 0, 1, 2])  # 1: abort in prefill, 2: abort in decode
            submitted += 1
        for out in eng.step():
            if out.finished:
                live.pop(out.request_id, None)
                finished += out.finish_reason != "abort"
        for rid, mode in list(live.items()):
            seq = eng.requests.get(rid)
            if seq is None or mode == 0:
                continue
            if mode == 1 and seq.num_computed_tokens > 0 and seq.in_prefill:
                aborted_prefill += eng.abort_request(rid)
            elif mode == 2 and seq.output_token_ids:
                aborted_decode += eng.abort_request(rid)
        eng.check_integrity()
    eng.check_integrity()
    stats = eng.stats()
    assert stats["used_blocks"] == 0
    assert stats["free_blocks"] + stats["cached_blocks"] == stats["num_blocks"] == 48
    assert aborted_prefill > 0 and aborted_decode > 0 and finished > 150


def test_preempted_request_recomputes_to_the_same_greedy_output(tiny) -> None:
    """Regression: recompute-preemption must not change a greedy continuation."""
    big = make_engine(tiny)
    tight = make_engine(tiny, kv_pool_bytes=12 * 8192, max_num_seqs=4)  # 12 blocks of 8 KiB
    prompts = [[(5 * i + k) % 400 + 1 for i in range(40)] for k in range(4)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = big.generate(prompts, sp)
    got = tight.generate(prompts, sp)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert sum(o.num_preemptions for o in got) > 0
    tight.check_integrity()
