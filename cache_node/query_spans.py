"""A prompt step's queries attended span by span (``Policy.prompt_span``, ``query_spans``).

Rule: under a policy whose attention depends on the step's queries (SentenceKV's recall picks
the sentences the queries point at before each layer attends), a prompt prefilled over such
KV is cut into spans at fixed absolute positions (the prompt's length less every multiple
of the span, so the last span is the prompt's last tokens, the question a turn asks and the
query the first output token is sampled from), never at the chunk's edges; each span's
queries select for themselves
(``Policy.before_attend``) and attend with what they selected. The scheduler ends prompt
chunks only at span cuts (``Sequence.chunk_tokens``), so a span is always whole in one step
and what a token attends depends on its position only, not on ``max_num_batched_tokens`` or
on the other requests that share its steps (chunked prefill: Agrawal et al., Sarathi-Serve,
OSDI'24; vLLM's scheduler sizes a prompt's chunk by what the step's token budget leaves).
Selection from a span's own queries is the SentenceKV paper's §3.3 (sentences chosen by the
current query's similarity; Zhu et al., arXiv 2504.00970), held over the span's tokens as
Quest and ShadowKV hold a selection over nearby queries.
"""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


def attend_spans(state: SequenceKV, layer_idx: int, q: torch.Tensor, q_pos: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, ctx_slots: torch.Tensor, cuts: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``SequenceKV.attend`` for queries ``q`` (n, H, d) at positions ``q_pos`` cut before the
    indices ``cuts``: each span runs the policy's ``before_attend`` on its own queries, then
    ``attend_all`` (causal, even for a lone query: never the fused decode path, so a span
    computes the same whichever step it is in) with the extra KV the policy then gives.
    What does not depend on the span is made once for the layer: the pool's K/V and causal
    bias (``SequenceKV.pool_part``) and what the policy keeps in ``Policy.span_scope``
    (SentenceKV: the unpacked key sketch); a whole span's pool products run per KV head
    (``attend_all``). Every span's selection and output are bit for bit those of the span
    computed alone (tests/test_query_spans_shared.py).
    Returns the output (n, H, d) and the pool part's probabilities (H_kv, g, n, S)."""
    policy, outs, probs = state.policy, [], []
    k, v, bias = state.pool_part(layer_idx, q_pos, k_cache, v_cache, ctx_slots, q.dtype, causal=True)
    with policy.span_scope(state, layer_idx):
        for a, b in pairwise([0, *cuts, q.shape[0]]):
            policy.before_attend(state, layer_idx, q[a:b], q_pos[a:b])
            out, p = state.attend_all(layer_idx, q[a:b], q_pos[a:b], k_cache, v_cache, ctx_slots,
                                      policy.extra_kv(state, layer_idx), causal=True,
                                      pool=(k, v, None if bias is None else bias[a:b]))
            outs.append(out)
            probs.append(p)
    return torch.cat(outs), torch.cat(probs, 2)
