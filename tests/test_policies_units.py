"""Policy-specific behaviour beyond the contract matrix: merging, sentence recall, G-KV decay."""

from __future__ import annotations

import pytest
import torch

from cache_node.policies import PolicyEnv, get_policy_class
from cache_node.policies.quant import pack_bits, quantize, unpack_bits
from cache_node.policies.sentencekv import (
    SHORTLIST_MIN_SENTENCES,
    QuantSentenceRegion,
    SentenceRegion,
    shortlist,
)
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
    rid = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                          policy="sentencekv-96-region_bits_0")  # the recall region in float32
    seq = run_to(eng, rid, 3)
    policy, store = seq.kv.policy, seq.kv.extra["sentences"]
    L, H_kv, d = eng.pool.num_layers, eng.pool.num_kv_heads, eng.pool.head_dim
    assert seq.kv.positions[:, :4].tolist() == [[0, 1, 2, 3]] * L  # the pool holds sinks + window
    assert seq.kv.frontier <= policy.pool_tokens(seq.kv) == 48
    assert all(len(p) <= 13 for p in store.positions) and len(store) >= 12
    held = torch.cat(store.positions).tolist()
    assert held == list(range(4, len(held) + 4))  # every demoted token is on the host, in order
    # the device tier pays for the 2-bit key sketch (codes + fp16 scale/zero per group of 16)
    assert store.sketch.nbytes == len(held) * L * H_kv * (d * 2 // 8 + 2 * 2 * d // 16)
    token = 2 * L * H_kv * d * 4
    assert store.region_tokens == 96 - -(-store.sketch.nbytes // token) - 48
    assert policy.extra_device_bytes(seq.kv) == store.sketch.nbytes + store.region_tokens * token
    assert seq.kv.device_bytes() <= 96 * token
    assert store.num_recalls >= L
    host = {int(p): (sid, i) for sid, ps in enumerate(store.positions) for i, p in enumerate(ps)}
    loaded = 0
    for layer in range(L):  # each head's region slots hold that head's K/V of the recalled tokens
        for head in range(H_kv):
            for slot, p in enumerate(store.region_positions[layer][head].tolist()):
                if p < 0:
                    continue
                sid, i = host[p]
                want = store.sentence_kv(sid, layer)[i, :, head]
                assert torch.equal(store.region_kv[layer][:, head, slot], want)
                loaded += 1
            sids = store.resident[layer][head]
            assert sum(len(store.positions[s]) for s in sids) <= store.region_tokens
    assert loaded > 0


@pytest.mark.parametrize("bits", [8, 4])
def test_sentencekv_quantized_region_holds_more_slots_and_attends_on_the_codes(tiny, bits: int) -> None:
    """``region_bits``: the recall region holds int8/int4 codes with a float16 scale and zero
    per 16 channels, so the same budget buys 3.2x (int8) or 5.3x (int4) the slots of float32
    K/V; each slot dequantizes to its host K/V within half a step, and the region's logits
    and outputs on the codes equal float attention over the dequantized K/V."""
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i % 13) + 1 for i in range(200)]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True),
                          policy=f"sentencekv-96-region_bits_{bits}")
    seq = run_to(eng, rid, 3)
    policy, store = seq.kv.policy, seq.kv.extra["sentences"]
    L, H_kv, d = eng.pool.num_layers, eng.pool.num_kv_heads, eng.pool.head_dim
    token = 2 * L * H_kv * d * 4
    left = 96 - -(-store.sketch.nbytes // token) - 48
    assert store.region_tokens == left * token // (L * 2 * H_kv * (d * bits // 8 + 4))
    assert store.region_tokens >= 3 * left if bits == 8 else store.region_tokens >= 5 * left
    assert policy.extra_device_bytes(seq.kv) == store.sketch.nbytes + store.region_nbytes
    assert seq.kv.device_bytes() <= 96 * token
    stacked = [torch.stack(t) for t in (store.region_kv, store.region_scale, store.region_zero)]  # equal R_l
    codes = unpack_bits(stacked[0], bits).float().unflatten(-1, (1, d))  # (L, 2, H_kv, R, 1, d)
    scale, zero = stacked[1].float().unsqueeze(-1), stacked[2].float().unsqueeze(-1)
    deq = (codes * scale + zero).flatten(-2)  # (L, 2, H_kv, R, d)
    host = {int(p): (sid, i) for sid, ps in enumerate(store.positions) for i, p in enumerate(ps)}
    loaded = 0
    for layer in range(L):
        for head in range(H_kv):
            for slot, p in enumerate(store.region_positions[layer][head].tolist()):
                if p < 0:
                    continue
                sid, i = host[p]
                want = store.sentence_kv(sid, layer)[i, :, head].float()  # (2, d)
                half_step = store.region_scale[layer][:, head, slot].float() / 2 + 1e-3  # (2, 1)
                assert ((deq[layer, :, head, slot] - want).abs() <= half_step).all()
                codes, scale, zero = quantize(want, bits, d)  # the codes made once, at demotion
                assert torch.equal(store.region_kv[layer][:, head, slot], pack_bits(codes, bits))
                assert torch.equal(store.region_scale[layer][:, head, slot], scale)
                loaded += 1
    assert loaded > store.region_tokens  # the slots are used, not just counted
    region = policy.extra_kv(seq.kv, 0)
    assert isinstance(region, QuantSentenceRegion)
    plain = SentenceRegion(store, 0)
    plain.k, plain.v = deq[0, 0], deq[0, 1]
    qh = torch.randn(H_kv, 2, 3, d)  # (H_kv, g, n, d)
    got, want = region.logits(qh, 0.25), plain.logits(qh, 0.25)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.allclose(got[~got.isinf()], want[~want.isinf()], atol=1e-4)
    probs = torch.softmax(want, -1).nan_to_num(0.0)
    assert torch.allclose(region.output(probs), plain.output(probs), atol=1e-4)


def test_sentencekv_rejects_an_unknown_region_width() -> None:
    with pytest.raises(ValueError, match="region_bits"):
        get_policy_class("sentencekv")(budget=96, region_bits=3)


def test_sentencekv_recall_picks_the_sentence_the_query_matches(tiny) -> None:
    """Sketch scoring: a query aligned with one token's key makes its sentence the top pick in
    every head, as exact attention over the host keys would."""
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 161)), SamplingParams(max_tokens=4, ignore_eos=True),
                          policy="sentencekv-96-max_sentence_tokens_8")
    seq = run_to(eng, rid, 1)
    policy, store = seq.kv.policy, seq.kv.extra["sentences"]
    target = 7
    key = store.sentence_kv(target, 0)[3, 0].float()  # layer 0, 4th token, (H_kv, d) post-RoPE key
    q = (100 * key / key.norm(dim=-1, keepdim=True)).repeat_interleave(2, 0).unsqueeze(0)  # (1, H=4, d)
    mass = store.sketch.log_mass(0, q, seq.kv.scaling, len(store)).amax(dim=(0, 2))  # (H_kv, S)
    exact = torch.stack([
        torch.einsum("hd,nhd->hn", q[0, ::2], store.sentence_kv(s, 0)[:, 0].float()).mul(seq.kv.scaling).logsumexp(-1)
        for s in range(len(store))], 1)
    assert mass.argmax(1).tolist() == exact.argmax(1).tolist() == [target, target]
    assert torch.allclose(mass.amax(1), exact.amax(1), rtol=0.15)  # log-mass from 2-bit codes
    policy.recall(seq.kv, 0, q)
    assert all(target in sids for sids in store.resident[0])


def test_sentencekv_cos_mode_keeps_the_papers_mean_keys(tiny) -> None:
    """``select_mode=cos`` (SentenceKV §3.3): one mean key per sentence, layer and KV head."""
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 161)), SamplingParams(max_tokens=4, ignore_eos=True),
                          policy="sentencekv-96-max_sentence_tokens_8-select_mode_cos")
    seq = run_to(eng, rid, 1)
    policy, store = seq.kv.policy, seq.kv.extra["sentences"]
    assert store.sketch is None
    target = 7
    mean = store.mean_keys[target, 0].view(2, 16)  # layer 0, (H_kv, d)
    assert torch.allclose(mean, store.sentence_kv(target, 0)[:, 0].float().mean(0), atol=1e-6)
    policy.recall(seq.kv, 0, mean.repeat_interleave(2, 0).unsqueeze(0))  # each group points at target
    assert all(target in sids for sids in store.resident[0])
    assert store.index_nbytes == len(store) * 2 * 2 * 16 * 4


def test_sentencekv_shortlist_is_each_heads_top_k_by_cosine() -> None:
    """Below ``SHORTLIST_MIN_SENTENCES`` every sentence is scored; from it on, the sorted union
    over KV heads of each head's ``k`` best mean keys by cosine with the chunk's mean unit query."""
    torch.manual_seed(0)
    s, h_kv, g, d, k = SHORTLIST_MIN_SENTENCES, 2, 3, 16, 40
    assert shortlist(torch.randn(s - 1, h_kv, d), torch.randn(1, h_kv * g, d), k) is None
    mk, q = torch.randn(s, h_kv, d), torch.randn(4, h_kv * g, d)
    got = shortlist(mk, q, k)
    qn = torch.nn.functional.normalize(q.view(4, h_kv, g, d), dim=-1).mean((0, 2))
    cos = torch.nn.functional.cosine_similarity(mk, qn.unsqueeze(0), dim=-1)  # (S, H_kv)
    want = set()
    for h in range(h_kv):
        want |= set(cos[:, h].argsort(descending=True)[:k].tolist())
    assert got is not None and got.tolist() == sorted(want)


def test_gkv_cumulative_attention_decays_per_token(tiny) -> None:
    """One decay per token past the prompt (a unit, ``AttentionStats.begin_step``), none for
    another chunk of the prompt already opened."""
    eng = make_engine(tiny)
    rid = eng.add_request(list(range(1, 61)), SamplingParams(max_tokens=12, ignore_eos=True),
                          policy="gkv-200-decay_0.5")
    seq = run_to(eng, rid, 1)
    stats = seq.kv.stats
    before = stats.cum[:, :, :60].clone()
    stats.begin_step(61, 60, 1, 60)  # the first decode token
    assert torch.allclose(stats.cum[:, :, :60], before * 0.5)
    stats.begin_step(63, 61, 2, 61)  # two tokens past a (new, e.g. next turn's) prompt: two units
    assert torch.allclose(stats.cum[:, :, :60], before * 0.5**3)
    stats.begin_step(64, 63, 1, 80)  # a prompt's first chunk opens its unit, its next chunk does not
    stats.begin_step(65, 64, 1, 80)
    assert torch.allclose(stats.cum[:, :, :60], before * 0.5**4)


def _sentencekv_engine(tiny, host_blocks: int):
    """The unit-test engine, with a host tier of ``host_blocks`` blocks (0: none)."""
    from cache_node.engine import LLMEngine
    from cache_node.tiers.manager import TierConfig

    base = make_engine(tiny)
    tier = TierConfig(host_bytes=host_blocks * base.pool.bytes_per_block) if host_blocks else None
    eng = LLMEngine(tiny.model, base.config, tiny.model_id, tiny.eos_token_ids, tier_config=tier)
    eng.policy_env = PolicyEnv(frozenset({13}))  # token 13 ends a sentence
    return eng


def test_sentencekv_keeps_its_sentences_in_the_engines_host_tier(tiny) -> None:
    """With a host tier, demoted sentences live in slots reserved there (same bytes, same
    tokens out as the sequence's own CPU store), the recall region's codes kept beside them
    are charged as whole slots more, and all leave it with the sequence."""
    from cache_node.policies.sentencekv import PrivateHostKV, TierHostKV

    prompt = [(i % 13) + 1 for i in range(200)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for host_blocks in (0, 32):
        eng = _sentencekv_engine(tiny, host_blocks)
        rid = eng.add_request(prompt, params, policy="sentencekv-96-bound_tier_host")  # key bounds too
        seq = run_to(eng, rid, 3)
        store = seq.kv.extra["sentences"]
        runs[host_blocks] = (eng, rid, store)
    (own_eng, own_rid, own), (eng, rid, store) = runs[0], runs[32]
    assert isinstance(own.host, PrivateHostKV) and isinstance(store.host, TierHostKV)
    demoted = sum(len(p) for p in store.positions)
    host = store.host
    beside = store.codes.nbytes + seq.kv.extra["key_bounds"].nbytes  # int8 region codes, key bounds
    assert host.charged_bytes == beside > store.codes.nbytes > 0
    assert len(host.charge_slots) == -(-beside // host.slot_bytes)
    assert len(host.slots) == -(-demoted // 16) > 0
    assert eng.tiers.host.stats()["host_reserved_slots"] == len(host.slots) + len(host.charge_slots)
    for sid in range(len(store)):
        for layer in range(eng.pool.num_layers):
            assert torch.equal(store.sentence_kv(sid, layer), own.sentence_kv(sid, layer))
    outs = []
    for e, r in ((own_eng, own_rid), (eng, rid)):
        while r in e.requests:
            out = e.step()
            outs += [o for o in out if o.request_id == r and o.finished]
    assert outs[0].output_token_ids == outs[1].output_token_ids
    assert eng.tiers.host.stats()["host_reserved_slots"] == 0
    eng.check_integrity()


def test_sentencekv_drops_sentences_when_the_host_tier_is_full(tiny) -> None:
    eng = _sentencekv_engine(tiny, 2)  # 32 tokens of host RAM for ~180 demoted tokens
    rid = eng.add_request([(i % 13) + 1 for i in range(200)], SamplingParams(max_tokens=6, ignore_eos=True),
                          policy="sentencekv-96")
    seq = run_to(eng, rid, 2)
    store = seq.kv.extra["sentences"]
    assert store.dropped_tokens > 0 and sum(len(p) for p in store.positions) <= 32
    assert eng.tiers.host.stats()["host_reserved_slots"] == 2
    eng.abort_request(rid)
    eng.step()
    assert eng.tiers.host.stats()["host_reserved_slots"] == 0
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0
