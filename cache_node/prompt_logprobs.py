"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's): each prompt token's log
probability, rank and top alternatives at its position, from the step that computes the
position before it.

A step's forward computes the hidden states of every token it runs; for a request that asks,
the positions of its chunk before the prompt's last (whose logits sample the first token)
and not taken before go through the model's ``lm_head`` in slices of ``LOGIT_ROWS`` rows,
each slice's log_softmax reduced at once to what was asked (the prompt token's logprob and
rank, the k most probable ids and logprobs): a long chunk never holds (chunk, vocab) logits,
only (``LOGIT_ROWS``, vocab) at a time. The step runs eager when one of its requests asks (a
CUDA graph returns only the rows it samples: ``ModelRunner.execute``'s ``on_hidden``). The
values reach the host in one copy, after the step's draw.

Every prompt position must be computed by the request itself, so such a request reads no
prefix cache past the positions it has taken (none before its first step: vLLM V1 skips the
prefix cache for them likewise; after a preemption its recomputation may reuse the blocks of
positions already taken, ``WaitingAdmission._reusable_blocks``), continues no session's KV (a
session turn computes its history again: ``SessionTable.attach``; under a compressing policy
it is marked ``session_state_dropped``) and may not name a compressed prefix
(``LLMEngine.add_request`` refuses ``prefix_tokens``). A recomputation (preemption, a failed
step) takes no position twice (``Sequence.prompt_logprobs_done``).

The values are those of the forward the request ran: under the full cache, the model's
(float32 log_softmax of the model dtype's logits). The compressing and quantizing policies
(SnapKV, quant, StreamingLLM, ...) keep a prompt's KV in full precision until its prefill ends
and compress it then, so theirs are the full-precision forward's too, chunked or not
(tests/test_prompt_logprobs.py: within 1e-4 of transformers'); a policy that compacted KV
mid-prompt would give those of the forward it ran, whose chunks attend earlier chunks' KV as
it kept them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from cache_node.outputs import PromptLogprob, SequenceFault

if TYPE_CHECKING:
    from cache_node.model_runner import ScheduledBatch
    from cache_node.sequence import Sequence

LOGIT_ROWS = 256
"""Prompt positions whose logits exist at once (a (256, vocab) float32 slice: 50 MB at a
49,152-token vocabulary, 131 MB at 128,256)."""


@dataclass
class Span:
    """Prompt positions ``first`` .. ``first + count - 1`` of ``seq``, at flat row ``flat`` of
    the step's hidden states."""

    seq: Sequence
    flat: int
    first: int
    count: int


def spans(batch: ScheduledBatch) -> list[Span]:
    """The positions of ``batch`` whose prompt logprobs are due: per asking sequence, those of
    its chunk before its prompt's last position and from ``prompt_logprobs_done`` on."""
    out, flat = [], 0
    for seq, n in batch:
        if seq.sampling_params.prompt_logprobs is not None:
            start = seq.num_computed_tokens
            lo, hi = max(start, seq.prompt_logprobs_done), min(start + n, seq.num_prompt_tokens - 1)
            if hi > lo > seq.prompt_logprobs_done:  # (admission never lets it skip a position): it fails alone
                raise SequenceFault(seq.request_id) from RuntimeError(
                    f"prompt logprobs would skip positions {seq.prompt_logprobs_done} to {lo - 1}")
            if hi > lo:
                out.append(Span(seq, flat + lo - start, lo, hi - lo))
        flat += n
    return out


class PromptLogprobsStep:
    """One step's prompt logprobs: ``__call__`` (the runner's ``on_hidden``) computes them on
    the device from the step's hidden states; ``commit`` brings them to the host and hands them
    to their sequences (``prompt_logprobs_out``). Returns the sequences that got some."""

    def __init__(self, lm_head: torch.nn.Module, todo: list[Span]) -> None:
        self.lm_head = lm_head
        self.todo = todo
        self.packed: list[torch.Tensor] = []

    def __call__(self, hidden: torch.Tensor) -> None:
        self.packed = [self._span(hidden, span) for span in self.todo]

    def _span(self, hidden: torch.Tensor, span: Span) -> torch.Tensor:
        """(count, 2 + 2k) float64: per position the prompt token's logprob and rank, then the k
        most probable ids and their logprobs, most probable first."""
        k = span.seq.sampling_params.prompt_logprobs or 0
        ids = span.seq.prompt_token_ids[span.first + 1: span.first + 1 + span.count]
        targets = torch.tensor(ids, dtype=torch.long, device=hidden.device)
        parts = []
        for a in range(0, span.count, LOGIT_ROWS):
            b = min(a + LOGIT_ROWS, span.count)
            logits = self.lm_head(hidden[span.flat + a: span.flat + b]).float()
            # -inf for what is not finite, as ``sampler.token_logprobs``
            lp = torch.nan_to_num(torch.log_softmax(logits, dim=-1), nan=-math.inf, posinf=-math.inf)
            del logits
            chosen = lp.gather(1, targets[a:b, None])
            rank = (lp > chosen).sum(dim=1, keepdim=True) + 1  # 1 + the tokens more probable (vLLM's)
            cols = [chosen, rank]
            if k:
                top = lp.topk(min(k, lp.shape[1]), dim=-1)
                cols += [top.indices, top.values]
            parts.append(torch.cat([c.to(torch.float64) for c in cols], dim=1))  # float64: ids past 2^24 exact
        return torch.cat(parts)

    def commit(self) -> list[Sequence]:
        if not self.packed:
            return []
        widths = [p.shape[1] for p in self.packed]
        values = torch.cat([p.flatten() for p in self.packed]).tolist()
        at, out = 0, []
        for span, width in zip(self.todo, widths):
            seq, top = span.seq, (width - 2) // 2
            for j in range(span.count):
                row = values[at: at + width]
                at += width
                token = seq.prompt_token_ids[span.first + 1 + j]
                seq.prompt_logprobs_out.append(PromptLogprob(
                    token, row[0], int(row[1]), tuple(zip(map(int, row[2: 2 + top]), row[2 + top:]))))
            seq.prompt_logprobs_done = span.first + span.count
            out.append(seq)
        self.packed = []
        return out
