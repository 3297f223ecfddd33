"""The served path of the quality harness (``python -m bench.quality --served``).

Where ``Probe.compress`` forks a prefilled context and compresses the fork, this asks through
what the server runs, ``LLMEngine.add_request(session_id=..., policy=spec)`` and
``LLMEngine.step``:

1. turn 1: the document alone (``max_tokens=1``). The engine prefills it in chunks under the
   policy and compresses it at the prompt's end, before any question exists; the session
   (``cache_node.sessions``) keeps the compacted state and the one reply token.
2. turn 2: history + question, the full cache's answer forced one decode step at a time: the
   engine samples each step, the sampled token is replaced by the forced one before the next
   step (teacher forcing), and the logits the engine samples from are recorded.

Each question gets its own session whose turn 1 is the same document (compression is
deterministic, so every session holds the same stored state), in a cache namespace of its own
so that no prefix-cache hit shortens its prefill (the probe computes the whole document too).
Those namespaces are salts of one namespace (``SERVED_NAMESPACE#salt=<session>``), so every
session counts as one holder in the host tier's fair shares (``cache_node.tiers.fair_lru``):
the cached documents of the sessions already closed are that holder's own entries, which its
next session's SentenceKV reservation evicts. With a bare namespace per session each closed
session stayed a holder of its own; once they filled the host tier, a new session's share was
the tier over their number, and SentenceKV dropped the demoted sentences past it (the tier's
documented fair share, docs/architecture.md, 'Tiers', "Tenant shares below the device").
A question turn that does not continue from the stored state raises: the served path would
then be a re-prefill, not the agent case it is meant to measure. A session whose stored or
question-turn state lost tokens for want of host room (``Policy.lost_tokens``) raises too:
its logits would measure the harness's host tier, not the policy.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from cache_node.engine import LLMEngine
from cache_node.kv_state import SequenceKV
from cache_node.model_runner import ScheduledBatch
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence

_ids = itertools.count()
SERVED_NAMESPACE = "quality-served"  # every session's namespace is a salt of it: one host-tier holder


@dataclass
class Answer:
    """One question asked through the engine.

    ``logits``: (1 + len(forced), V) float32, the prediction after the prompt and after each
    forced token. ``stored_bytes``: device bytes the idle session held between the turns
    (pool blocks + the policy's device extras). ``peak_bytes``: the most device bytes the
    question turn held after a step. ``reply``: the document turn's output token ids.
    ``recall_s``: SentenceKV's recall seconds in the question turn (0 for other policies).
    """

    logits: torch.Tensor
    stored_bytes: int
    peak_bytes: int
    reply: list[int] = field(default_factory=list)
    recall_s: float = 0.0


class ServedAsker:
    """Document as a session's first turn, each question a later turn, through ``engine``.

    The engine must be idle (no other requests): the steps run here drive it.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def ask(self, spec: str, context: list[int], prompt: list[int], forced: list[int]) -> Answer:
        """Turn 1 ``context`` under policy ``spec`` ("full" = none), turn 2 ``prompt`` then
        ``forced`` teacher-forced.

        Raises:
            RuntimeError: the question turn did not continue from the session's stored state
                (it would have prefilled the history again), or the session's state lost tokens
                for want of host-tier room (after the document turn or the question turn).
        """
        eng = self.engine
        sid = f"served-{next(_ids)}"
        policy = "" if spec == "full" else spec
        kw = {"session_id": sid, "policy": policy, "cache_namespace": f"{SERVED_NAMESPACE}#salt={sid}"}
        self._run(eng.add_request(context, SamplingParams(max_tokens=1), **kw), [])
        sess = eng.sessions.sessions[sid]
        _check_kept(sess.kv, spec, "document turn")
        history = list(sess.token_ids)
        stored = len(sess.blocks) * eng.pool.bytes_per_block
        if sess.kv is not None:
            stored += sess.kv.policy.extra_device_bytes(sess.kv)
        try:
            params = SamplingParams(max_tokens=len(forced) + 1, ignore_eos=True)
            rid = eng.add_request(history + prompt, params, **kw)
            seq = eng.requests[rid]
            if seq.num_cached_tokens != sess.num_computed_tokens:
                raise RuntimeError(f"served question turn of {spec!r} re-prefilled the history "
                                   f"({seq.num_cached_tokens} of {sess.num_computed_tokens} tokens kept)")
            rows, peak, recall_s = self._run(rid, forced)
            _check_kept(eng.sessions.sessions[sid].kv, spec, "question turn")
        finally:
            eng.close_session(sid)
        return Answer(torch.stack(rows), stored, peak, history[len(context):], recall_s)

    def _run(self, rid: str, forced: list[int]) -> tuple[list[torch.Tensor], int, float]:
        """Step the engine until request ``rid`` finishes, replacing its ``k``-th sampled token
        by ``forced[k]``. Returns (logit rows it sampled from, peak device bytes, recall s)."""
        eng = self.engine
        seq = eng.requests[rid]
        rows: list[torch.Tensor] = []
        real = eng.runner.execute

        def execute(batch: ScheduledBatch, all_logits: bool = False, **kw: Any) -> torch.Tensor:
            out = real(batch, all_logits, **kw)  # (``on_hidden``: prompt logprobs)
            rows.extend(out)  # one request runs: a row only when its chunk ends the known tokens
            return out

        eng.runner.execute = execute
        peak, recall_s = 0, 0.0
        try:
            while not seq.is_finished:
                eng.step()
                peak = max(peak, _device_bytes(eng, seq))
                store = None if seq.kv is None else seq.kv.extra.get("sentences")
                recall_s = store.recall_s if store is not None else recall_s
                k = len(seq.output_token_ids)
                if not seq.is_finished and 0 < k <= len(forced):
                    seq.output_token_ids[-1] = forced[k - 1]
        finally:
            del eng.runner.execute  # the instance attribute shadowed the method
        return rows, peak, recall_s


def _device_bytes(eng: LLMEngine, seq: Sequence) -> int:
    """Device bytes ``seq`` holds now (0 once finished: the session took its blocks)."""
    if seq.kv is not None:
        return seq.kv.device_bytes()
    return len(seq.block_table) * eng.pool.bytes_per_block


def _check_kept(kv: SequenceKV | None, spec: str, turn: str) -> None:
    """Raise RuntimeError when the session state ``kv`` lost tokens for want of host-tier room."""
    lost = 0 if kv is None else kv.policy.lost_tokens(kv)
    if lost:
        raise RuntimeError(f"served {spec!r}: the session lost {lost} tokens of its state after the {turn} "
                           f"(host tier full); its logits would measure the tier, not the policy")
