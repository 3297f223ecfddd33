"""Policy-specific behaviour beyond the contract matrix: merging, sentence recall, G-KV decay."""

from __future__ import annotations

import torch

from cache_node.policies import PolicyEnv, make_policy
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def run_to(eng, rid: str, n: int):
    while len(eng.requests[rid].output_token_ids) < n:
        eng.step()
    return eng.requests[rid]


def test_spindlekv_merges_shallow_layers_and_counts_support(tiny) -> None:
    """Shallow layer 0 folds dropped tokens into kept entries: support sums to kept + merged;
    deep layer 1 only evicts (support stays 1)."""
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 121)), SamplingParams(max_tokens=8, ignore_eos=True),
                          policy="spindlekv-40-merge_threshold_0.2-shallow_fraction_0.5")
    seq = run_to(eng, rid, 2)
    support, pos = seq.kv.support, seq.kv.positions
    assert float(support[0].max()) > 1
    assert float(support[1][pos[1] >= 0].max()) == 1.0
    assert float(support[0].sum()) <= seq.num_computed_tokens
    assert int((pos[0] >= 0).sum()) <= 40


def test_sentencekv_demotes_to_host_and_recalls_by_query(tiny) -> None:
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))  # token 13 ends a sentence
    prompt = [(i % 13) + 1 for i in range(200)]  # sentences of 13 tokens ending in 13
    rid = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True), policy="sentencekv-64")
    seq = run_to(eng, rid, 3)
    store = seq.kv.extra["sentences"]
    start, r = seq.kv.extra["region"]
    assert start == 4 and all(len(p) <= 13 for p in store.positions)
    lengths = sorted({len(p) for p in store.positions})
    assert 13 in lengths and len(store) >= 12
    assert r == (64 - -(-len(store) // 2)) // 16 * 16 - 16 - 4 - 16  # whole blocks, one of headroom
    held = torch.cat(store.positions).tolist()
    assert sorted(held) == list(range(4, len(held) + 4))  # every demoted token is on the host
    assert store.num_recalls >= eng.pool.num_layers
    region = seq.kv.positions[:, start : start + r]
    loaded = region[region >= 0]
    assert len(loaded) > 0 and set(loaded.tolist()) <= set(held)
    # the device tier pays for the mean keys: one (H_kv * d) float vector per sentence and layer
    assert make_policy("sentencekv").extra_device_bytes(seq.kv) == len(store) * 2 * 2 * 16 * 4


def test_sentencekv_recall_picks_the_sentence_the_query_matches(tiny) -> None:
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 161)), SamplingParams(max_tokens=4, ignore_eos=True),
                          policy="sentencekv-64-max_sentence_tokens_8")
    seq = run_to(eng, rid, 1)
    policy, store = seq.kv.policy, seq.kv.extra["sentences"]
    target = 7
    mean = store.mean_keys[target, 0].view(2, 16)  # layer 0, (H_kv, d) unit/sqrt(2)
    q = mean.repeat_interleave(2, 0).unsqueeze(0)  # (1, H=4, d): each group points at target
    policy.recall(seq.kv, 0, q)
    assert target in store.resident[0]
    # the device-tier mean key is the sentence's mean post-RoPE key per head (host keys: [:, :, 0])
    assert torch.allclose(mean, store.host_kv[target][0, :, 0].float().mean(0), atol=1e-6)


def test_gkv_cumulative_attention_decays_per_step(tiny) -> None:
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 61)), SamplingParams(max_tokens=12, ignore_eos=True),
                          policy="gkv-200-decay_0.5")
    seq = run_to(eng, rid, 1)
    stats = seq.kv.stats
    before = stats.cum[:, :, :60].clone()
    stats.begin_step(61)
    assert torch.allclose(stats.cum[:, :, :60], before * 0.5)
