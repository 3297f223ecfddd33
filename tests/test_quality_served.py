"""The quality harness's two question-agnostic paths agree on the real model: ``Probe.compress``
(prefill once, fork, compress the fork, ask) and the served path (``bench.quality_served``:
the document as a session's first turn through ``LLMEngine.add_request``, each question a
later turn continuing from the state the session stored)."""

from __future__ import annotations

import torch

from bench.quality import build_items, kl_and_agreement, reference
from bench.quality_probe import Probe
from bench.quality_served import ServedAsker
from bench.quality_trace import kv_bytes_per_token
from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.policies import PolicyEnv
from cache_node.tiers.manager import TierConfig

DOC, CHUNK = 256, 128  # the context's tokens, prefilled in two chunks


def test_served_session_answers_equal_the_probes_compress_once_ask_many(real_model) -> None:
    """One 256-token context (prefilled in two 128-token chunks on both paths, as the harness's
    1k contexts are in two of 512), both questions, sentencekv-0.25: the served path's logits,
    answers and KL equal the probe's, the session stores the bytes the probe's compressed fork holds, and
    each question turn prefills only its own tokens over the stored state (no fallback to a
    re-prefill). Fails when the two paths compute different compressions: a prefix-cache hit
    that shortens the document turn, a session turn that re-prefills, or statistics or budgets
    of the probe's fork that the served turn does not have."""
    tok = real_model.tokenizer
    engine = LLMEngine(real_model.model, EngineConfig(kv_pool_bytes=1 << 28, max_num_batched_tokens=CHUNK),
                       real_model.model_id, real_model.eos_token_ids, tier_config=TierConfig(host_bytes=1 << 27))
    engine.policy_env = PolicyEnv.from_tokenizer(tok)
    probe, asker = Probe(engine, chunk_tokens=CHUNK), ServedAsker(engine)
    item = build_items(tok, [DOC], [0.5])[0]
    assert len(item["context"]) == DOC == 2 * CHUNK and len(item["questions"]) == 2
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


def test_served_and_probe_keep_their_answers_once_earlier_sessions_fill_the_host_tier(real_model) -> None:
    """The case ``bench.quality --quick --lengths 1024 --contexts 2 --served`` reproduced: after
    the earlier questions' sessions (full cache here) had filled the host tier with their
    cached documents, sentencekv-0.25 answered other logits than on a fresh engine (served KL
    0.83 against the probe's 0.037, needle 0.50 against 1.00), as each closed session's
    namespace was a host-tier holder of its own and a new state's fair share of the tier was
    too small for its demoted sentences, which were dropped. Now the sessions' namespaces are
    salts of one (one holder, whose next reservation evicts its own dead documents): both paths
    give the fresh engine's logits, the probe's and the served one's agree, nothing is dropped.
    Here a 256-token document and a host tier of three served histories, filled by three
    sessions (each asked one forced token: their answers are not checked). With one host-tier
    holder per session's namespace (the fault) the probe's compressed state loses 109 tokens."""
    tok = real_model.tokenizer
    slot_bytes = 16 * kv_bytes_per_token(real_model.model)
    history_slots = DOC // 16 + 2  # the document's blocks and the question turn's
    engine = LLMEngine(real_model.model, EngineConfig(kv_pool_bytes=1 << 28, max_num_batched_tokens=CHUNK),
                       real_model.model_id, real_model.eos_token_ids,
                       tier_config=TierConfig(host_bytes=3 * history_slots * slot_bytes))  # three served histories
    engine.policy_env = PolicyEnv.from_tokenizer(tok)
    probe, asker = Probe(engine, chunk_tokens=CHUNK), ServedAsker(engine)
    item = build_items(tok, [DOC], [0.5])[0]
    item["questions"] = item["questions"][:1]  # (the one asked: the reference answers no other)
    ref = reference(probe, tok, item, served=True)
    _kind, q, gen, _need, _ref_logits, _ok = ref.answers[0]
    prompt = q[len(item["reply"]):]

    def both() -> tuple[torch.Tensor, torch.Tensor]:
        comp = probe.compress(ref.base, "sentencekv-0.25")
        seq = probe.fork(comp)
        probed = probe.teacher_force(seq, q, gen, decode=True)
        probe.release(seq)
        probe.release(comp)
        return probed, asker.ask("sentencekv-0.25", item["context"], prompt, gen).logits

    fresh_probed, fresh_served = both()
    for _ in range(3):
        asker.ask("full", item["context"], prompt, gen[:1])
        engine.tiers.demote_all()
    host = engine.tiers.host
    assert len(host.entries) + len(host._free_slots) == host.num_slots and len(host._free_slots) < 4
    probed, served = both()
    assert engine.tiers.counters["policy_dropped_tokens"] == 0
    assert torch.allclose(probed, fresh_probed, atol=1e-4)
    assert torch.allclose(served, fresh_served, atol=1e-4)
    assert torch.allclose(served, probed, atol=1e-4)
    probe.release(ref.base)
    engine.check_integrity()
