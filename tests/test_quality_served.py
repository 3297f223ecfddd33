"""The quality harness's two question-agnostic paths agree on the real model: ``Probe.compress``
(prefill once, fork, compress the fork, ask) and the served path (``bench.quality_served``:
the document as a session's first turn through ``LLMEngine.add_request``, each question a
later turn continuing from the state the session stored)."""

from __future__ import annotations

import torch

from bench.quality import build_items, kl_and_agreement, reference
from bench.quality_probe import Probe
from bench.quality_served import ServedAsker
from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv
from cache_node.tiers.manager import TierConfig


def test_served_session_answers_equal_the_probes_compress_once_ask_many(real_model) -> None:
    """One 512-token context (prefilled in two 256-token chunks on both paths, as the harness's
    1k contexts are in two of 512), both questions, sentencekv-0.25: the served path's logits,
    answers and KL equal the probe's, the session stores the bytes the probe's compressed fork holds, and
    each question turn prefills only its own tokens over the stored state (no fallback to a
    re-prefill). Fails when the two paths compute different compressions: a prefix-cache hit
    that shortens the document turn, a session turn that re-prefills, or statistics or budgets
    of the probe's fork that the served turn does not have."""
    tok = real_model.tokenizer
    engine = LLMEngine(real_model.model, EngineConfig(kv_pool_bytes=1 << 28, max_num_batched_tokens=256),
                       real_model.model_id, real_model.eos_token_ids, tier_config=TierConfig(host_bytes=1 << 27))
    engine.policy_env = PolicyEnv.from_tokenizer(tok)
    probe, asker = Probe(engine, chunk_tokens=256), ServedAsker(engine)
    item = build_items(tok, [512], [0.5])[0]
    assert len(item["context"]) == 512 and len(item["questions"]) == 2
    ref = reference(probe, tok, item, served=True)
    comp = probe.compress(ref.base, "sentencekv-0.25")
    reply = item["reply"]
    for _kind, q, gen, _need, ref_logits, _ok in ref.answers:
        seq = probe.fork(comp)
        probed = probe.teacher_force(seq, q, gen, decode=True)
        probe.release(seq)
        continued = engine.sessions.num_policy_continuations
        served = asker.ask("sentencekv-0.25", item["context"], q[len(reply):], gen)
        assert engine.sessions.num_policy_continuations == continued + 1
        assert served.reply == reply
        assert served.stored_bytes == comp.kv.device_bytes()
        assert served.logits.shape == probed.shape == (len(gen) + 1, real_model.model.config.vocab_size)
        assert torch.equal(served.logits.argmax(-1), probed.argmax(-1))
        assert torch.allclose(served.logits, probed, atol=1e-4)
        kl_probe, _ = kl_and_agreement(ref_logits, probed)
        kl_served, _ = kl_and_agreement(ref_logits, served.logits)
        assert abs(kl_probe - kl_served) < 1e-5
    assert engine.sessions.num_fallbacks == 0 and not engine.sessions.sessions
    probe.release(comp)
    probe.release(ref.base)
    engine.check_integrity()
