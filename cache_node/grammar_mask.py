"""A request's grammar while it decodes: its state (``GrammarState``: the compilation, then the
matcher) and the step's mask (``constrain``).

Each step, for the rows that have a matcher only, ``constrain`` fills their rows of one host
bitmask (xgrammar's ``fill_next_token_bitmask``), copies it to the logits' device and sets
every token the grammar does not allow to -inf there (``apply_token_bitmask_inplace``); after
the draw the engine feeds each constrained row its token (``cache_node.engine_grammars``). A
step with no constrained row does nothing of this. Compiling is ``cache_node.grammars``'.

The order of the logits steps is vLLM V1's: the grammar mask is applied to the model's logits
before the sampler (``vllm.v1.worker.gpu_model_runner``), so its log probabilities
(``raw_logprobs``) are those of the masked distribution: a token the grammar forbids has
log probability -inf. Everything else (``allowed_token_ids``, ``logit_bias``, penalties,
``min_tokens``, temperature, min-p, top-k, top-p) comes after, on the allowed tokens.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from cache_node.grammars import Grammars
from cache_node.structured_output import StructuredOutputSpec


class GrammarState:
    """One request's grammar: its compilation, then its matcher (the grammar's state after
    every output token so far; fed each token once, when it is appended to the output, so a
    preempted request, recomputed or swapped, continues from the same state)."""

    def __init__(self, grammars: Grammars, spec: StructuredOutputSpec, tenant: str = "") -> None:
        """Raises ``GrammarQueueFull`` (``Grammars.compile``)."""
        self.grammars = grammars
        self.spec = spec
        self.future = grammars.compile(spec, tenant)
        self.matcher: Any = None
        self.error: str | None = None
        self._released = False

    def release(self) -> None:
        """Its request ended: it waits on its compilation no more (``Grammars.release``: a queued
        compile no other request waits on is dropped). Idempotent; nothing once it compiled."""
        if not self._released and not self.future.done():
            self._released = True
            self.grammars.release(self.spec, self.future)

    @property
    def ready(self) -> bool:
        """Its matcher exists (the request may be scheduled)."""
        return self.matcher is not None

    def poll(self) -> bool:
        """Whether the compilation ended; then ``matcher`` or ``error`` is set."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        if self.future.cancelled():  # dropped: every request waiting on it was released
            self.error = "structured_output: its compile was dropped (its request ended)"
            return True
        exc = self.future.exception()
        if exc is not None:
            self.error = str(exc) if isinstance(exc, ValueError) else f"structured_output: {type(exc).__name__}: {exc}"
        else:
            self.matcher = self.grammars.matcher(self.future.result())
        return True


def _bits(ids: Collection[int], words: int) -> np.ndarray:
    """A (words,) uint32 bitmask with the bits of ``ids`` (those under ``words * 32``) set."""
    out = np.zeros(words, dtype=np.uint32)
    index = np.fromiter((t for t in ids if 0 <= t < words * 32), dtype=np.int64)
    np.bitwise_or.at(out, index >> 5, np.left_shift(np.uint32(1), (index & 31).astype(np.uint32)))
    return out


def constrain(grammars: Grammars, logits: torch.Tensor, states: list[GrammarState | None],
              held: list[Collection[int]], allowed: list[Collection[int] | None]) -> tuple[list[int], list[int]]:
    """Mask each constrained row of ``logits`` (num_rows, vocab), in place, to its grammar.

    Args:
        states: per row, its ``GrammarState`` (ready) or None (unconstrained: untouched).
        held: per row, the token ids ``min_tokens`` holds back this step (empty when none).
        allowed: per row, its ``allowed_token_ids`` (None: all).

    Returns:
        ``(complete, stuck)``: the constrained rows with no token that the grammar, ``held`` and
        ``allowed`` all let through (their masked logits would be all -inf: nothing to draw,
        and a NaN draw on a GPU is fatal): those whose grammar may end here (it allows its stop
        token: the output is complete), and the others. Checked on the host bitmask, only for
        rows with ``held`` or ``allowed``: no device sync.
    """
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return [], []
    bitmask = grammars.bitmask
    complete: list[int] = []
    stuck: list[int] = []
    for i in rows:
        states[i].matcher.fill_next_token_bitmask(bitmask, i)  # type: ignore[union-attr]
        if held[i] or allowed[i] is not None:
            grammar = bitmask[i].numpy().view(np.uint32)
            words = grammar & ~_bits(held[i], grammar.shape[0])
            if allowed[i] is not None:
                words &= _bits(allowed[i], grammar.shape[0])  # type: ignore[arg-type]
            if not words.any():
                ends = (grammar & _bits(grammars.stop_token_ids, grammar.shape[0])).any()
                (complete if ends else stuck).append(i)
    mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    grammars.xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=grammars.vocab_size, indices=rows)
    return complete, stuck
