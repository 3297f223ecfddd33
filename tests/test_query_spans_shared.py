"""A prompt step's spans (``cache_node.query_spans.attend_spans``) share what does not depend on
the span: the layer's pool K/V and causal mask (``SequenceKVAttention.pool_part``, once per
layer and step) and SentenceKV's unpacked key sketch (``KeySketch.held``, through
``Policy.span_scope``). Each span still selects and attends with the same arithmetic, so every
attention output equals the per-span reference bit for bit (hangs review 21 F4: a 1400-token
turn gathered the pool and unpacked the sketch once per 16 tokens and layer).
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from cache_node import kv_state_attention
from cache_node.policies import PolicyEnv
from cache_node.policies.sentencekv import sketch as sketch_mod
from cache_node.policies.sentencekv.sketch import KeySketch
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def reference_spans(state, layer_idx, q, q_pos, k_cache, v_cache, ctx_slots, cuts):  # type: ignore[no-untyped-def]
    """``attend_spans`` before the sharing: each span prepares everything itself."""
    policy, outs, probs = state.policy, [], []
    for a, b in pairwise([0, *cuts, q.shape[0]]):
        policy.before_attend(state, layer_idx, q[a:b], q_pos[a:b])
        out, p = state.attend_all(layer_idx, q[a:b], q_pos[a:b], k_cache, v_cache, ctx_slots,
                                  policy.extra_kv(state, layer_idx), causal=True)
        outs.append(out)
        probs.append(p)
    return torch.cat(outs), torch.cat(probs, 2)


def prompt(n: int, off: int) -> list[int]:
    return [13 if i % 12 == 11 else (7 * i + off) % 400 + 20 for i in range(n)]  # 13 ends a sentence


def session(tiny, policy: str, monkeypatch, reference: bool):  # type: ignore[no-untyped-def]
    """Two turns (the second, 300 new tokens, prefilled in spans over the first's demoted
    sentences in steps of up to 128 tokens); every attention output of the second turn, the
    tokens decoded, and the calls counted."""
    with monkeypatch.context() as m:
        if reference:
            m.setattr(kv_state_attention, "attend_spans", reference_spans)
        counts = {"pool_part": 0, "unpack": 0, "spans": 0}
        outs: list[torch.Tensor] = []
        attend, pool_part = kv_state_attention.SequenceKVAttention.attend, kv_state_attention.SequenceKVAttention.pool_part
        spans, unpack = kv_state_attention.attend_spans, sketch_mod.unpack_bits_float

        def spy_attend(self, *a, **k):  # type: ignore[no-untyped-def]
            out = attend(self, *a, **k)
            outs.append(out.clone())
            return out

        def spy_pool_part(self, *a, **k):  # type: ignore[no-untyped-def]
            counts["pool_part"] += 1
            return pool_part(self, *a, **k)

        def spy_spans(*a, **k):  # type: ignore[no-untyped-def]
            counts["spans"] += 1
            return spans(*a, **k)

        def spy_unpack(*a, **k):  # type: ignore[no-untyped-def]
            counts["unpack"] += 1
            return unpack(*a, **k)

        m.setattr(kv_state_attention.SequenceKVAttention, "attend", spy_attend)
        m.setattr(kv_state_attention.SequenceKVAttention, "pool_part", spy_pool_part)
        m.setattr(kv_state_attention, "attend_spans", spy_spans)
        m.setattr(sketch_mod, "unpack_bits_float", spy_unpack)
        eng = make_engine(tiny, kv_pool_bytes=4096 * 8192, max_num_batched_tokens=128, max_num_seqs=4)
        eng.policy_env = PolicyEnv(frozenset({13}))
        hist: list[int] = []
        tokens = []
        for t, (n, off) in enumerate([(400, 3), (300, 77)]):
            outs.clear()
            for key in counts:
                counts[key] = 0
            rid = eng.add_request(hist + prompt(n, off), SamplingParams(max_tokens=3, ignore_eos=True),
                                  request_id=f"t{t}", session_id="s", policy=policy)
            done = None
            for _ in range(200):
                done = next((o for o in eng.step() if o.finished and o.request_id == rid), None)
                if done is not None:
                    break
            assert done is not None
            hist = eng.session_history("s")
            tokens.append(done.output_token_ids)
    return outs, tokens, counts


@pytest.mark.parametrize("policy", ["sentencekv-0.25", "sentencekv-0.125", "sentencekv-0.25-select_mode_cos"])
def test_shared_span_work_gives_the_reference_outputs(tiny, monkeypatch, policy: str) -> None:
    outs, tokens, counts = session(tiny, policy, monkeypatch, reference=False)
    ref_outs, ref_tokens, ref_counts = session(tiny, policy, monkeypatch, reference=True)
    assert counts["spans"] >= 4  # the turn took several steps of spans, in each layer
    assert tokens == ref_tokens
    assert len(outs) == len(ref_outs)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref_outs))
    # the pool part once per layer and step, not once per span (the reference: once per span)
    assert counts["pool_part"] == counts["spans"] < ref_counts["pool_part"]
    if policy == "sentencekv-0.25":  # scored on the sketch: unpacked once per layer and step
        # (the decode steps unpack as before; the reference unpacks again for each further span)
        assert ref_counts["unpack"] - counts["unpack"] == ref_counts["pool_part"] - counts["pool_part"]


@pytest.mark.parametrize("rank", [0, 8])
def test_held_sketch_scores_equal_fresh_ones(rank: int) -> None:
    torch.manual_seed(0)
    sk = KeySketch(2, 8, rank)
    for s in range(5):
        sk.append(torch.randn(2, 7, 2, 16), s)
    q = torch.randn(16, 4, 16)
    fresh = [sk.log_mass(layer, q.clone(), 0.25, 5) for layer in (0, 1)]
    with sk.held():
        for _ in range(2):  # the second pass reads the held codes
            for layer in (0, 1):
                assert torch.equal(sk.log_mass(layer, q.clone(), 0.25, 5), fresh[layer])
        sk.append(torch.randn(2, 7, 2, 16), 5)  # new codes: the held ones no longer apply
        held = sk.log_mass(1, q.clone(), 0.25, 6)
    assert sk._held is None
    assert torch.equal(held, sk.log_mass(1, q.clone(), 0.25, 6))
    assert held.shape[-1] == 6
