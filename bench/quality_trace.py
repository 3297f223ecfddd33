"""``memory_vs_position`` of the quality harness: device bytes of one agent session as its
history grows to the model's context length.

A document (the harness's longest context) is fed to one session turn by turn, ``turn_tokens``
new tokens per turn (``max_tokens=1``), through ``LLMEngine.add_request(session_id=...,
policy=spec)``, as an agent reading a long text does: each turn prefills only its new tokens
over the stored state, and a compressing policy compresses at the turn's end
(``cache_node.sessions``). After every engine step the point (tokens computed, device bytes the
sequence holds: pool blocks + the policy's device extras) is recorded, so the plot shows the
peak of each turn's prefill as well as what the policy keeps between turns.
"""

from __future__ import annotations

from typing import Any

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.policies import PolicyEnv
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig


def kv_bytes_per_token(model: Any) -> int:
    """Full-cache KV bytes of one token of ``model`` in the engine's default dtype."""
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim,
                                  EngineConfig().resolved().torch_dtype)


def pool_bytes(bytes_per_token: int, tokens: int, slack_tokens: int = 4096) -> int:
    """Pool bytes for ``tokens`` of full-cache KV plus ``slack_tokens`` of headroom (charge
    blocks, the next chunk, copy-on-write of a compaction)."""
    return bytes_per_token * (tokens + slack_tokens)


def session_trace(lm: Any, env: PolicyEnv, spec: str, document: list[int], turn_tokens: int = 512,
                  chunk_tokens: int = 512) -> list[tuple[int, int]]:
    """(tokens computed, device bytes) after every step of one session over ``document``.

    ``spec``: a policy spec, "full" for none. The engine gets a pool and a host tier sized for
    ``document`` (``pool_bytes``), chunked prefill of ``chunk_tokens`` per step.

    Raises:
        RuntimeError: a turn did not continue from the session's stored state.
    """
    size = pool_bytes(kv_bytes_per_token(lm.model), len(document))
    eng = LLMEngine(lm.model, EngineConfig(kv_pool_bytes=size, max_num_batched_tokens=chunk_tokens),
                    tier_config=TierConfig(host_bytes=size))
    eng.policy_env = env
    sid, policy = f"trace-{spec}", "" if spec == "full" else spec
    points: list[tuple[int, int]] = []
    history: list[int] = []
    for fed in range(0, len(document), turn_tokens):
        prompt = history + document[fed : fed + turn_tokens]  # history: the document so far + replies
        rid = eng.add_request(prompt, SamplingParams(max_tokens=1), session_id=sid, policy=policy)
        seq = eng.requests[rid]
        if history and seq.num_cached_tokens != len(history) - 1:
            raise RuntimeError(f"trace turn of {spec!r} re-prefilled the history")
        while not seq.is_finished:
            eng.step()
            if not seq.is_finished:
                points.append((seq.num_computed_tokens, _held(eng, seq)))
        sess = eng.sessions.sessions[sid]
        held = len(sess.blocks) * eng.pool.bytes_per_block
        if sess.kv is not None:
            held += sess.kv.policy.extra_device_bytes(sess.kv)
        points.append((sess.num_computed_tokens, held))
        history = list(sess.token_ids)
    eng.close_session(sid)
    return points


def _held(eng: LLMEngine, seq: Any) -> int:
    if seq.kv is not None:
        return seq.kv.device_bytes()
    return len(seq.block_table) * eng.pool.bytes_per_block


def memory_trace(lm: Any, env: PolicyEnv, specs: list[str], document: list[int],
                 turn_tokens: int = 512) -> dict[str, list[tuple[int, int]]]:
    """``session_trace`` per spec."""
    return {spec: session_trace(lm, env, spec, document, turn_tokens) for spec in specs}
