"""Next-token selection: greedy, or temperature + min-p + top-k + top-p sampling with
per-request seeds, after the requests' ``allowed_token_ids``, ``logit_bias``, penalties and
``min_tokens``; and the log probabilities of the rows that ask for them.

Everything runs on the logits' device: the allowed-token masks, logit biases, penalties and
``min_tokens`` mask are applied to the rows that ask for them in a few batched ops (nothing at
all when no row does), greedy rows take one batched argmax, each sampled row draws from its
request's own generator (created on that device, ``LLMEngine.add_request``), and the chosen ids
come back to the host in one ``tolist()``, the step's only host sync (the token ids the
penalties count go host -> device each step; a request's allowed ids and biases once, on its
first step: ``TokenConstraints``).

The order is vLLM V1's (``vllm.v1.sample.sampler``): on the raw logits the
``allowed_token_ids`` mask, then the ``logit_bias`` and the ``min_tokens`` mask (non
argmax-invariant logits processors), then the repetition, frequency and presence penalties;
greedy rows take their argmax there; then temperature, then min-p (one of vLLM's
argmax-invariant logits processors, applied before top-k/top-p), then top-k, then top-p.

Log probabilities (``SamplingParams.logprobs``) are vLLM V1's default ``raw_logprobs``: the
log_softmax of the model's raw logits, before penalties, temperature and filters, taken for
the rows that ask in one batched log_softmax, gather and topk, and brought to the host in the
same ``tolist()`` as the chosen ids (``draw``); a step where no row asks computes none.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from cache_node.outputs import SequenceFault, TokenLogprobs
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence


def _seen(ids: list[list[int]], vocab: int, device: torch.device, counts: bool) -> torch.Tensor:
    """(len(ids), vocab): per row, how often each token id occurs in its list (``counts``,
    float32) or whether it does (bool). One padded host -> device copy and one scatter; the
    padding lands in an extra column that is cut off."""
    width = max(1, max(len(row) for row in ids))
    index = torch.tensor([row + [vocab] * (width - len(row)) for row in ids], dtype=torch.long, device=device)
    if counts:
        out = torch.zeros(len(ids), vocab + 1, dtype=torch.float32, device=device)
        out.scatter_add_(1, index, torch.ones(index.shape, dtype=torch.float32, device=device))
    else:
        out = torch.zeros(len(ids), vocab + 1, dtype=torch.bool, device=device)
        out.scatter_(1, index, True)
    return out[:, :vocab]


def _entries(rows: list[int], columns: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of every entry of ``columns[j]`` (a request's cached
    LongTensor on ``device``, ``_constraints``) in row ``rows[j]``: the columns concatenated
    and the row numbers repeated on the device, with one small host -> device copy (the row
    numbers and the counts) and no host sync (the output size is known on the host)."""
    counts = [c.numel() for c in columns]
    spec = torch.tensor(rows + counts, dtype=torch.long).to(device)
    index = torch.repeat_interleave(spec[: len(rows)], spec[len(rows):], output_size=sum(counts))
    return index, torch.cat(columns)


@dataclass(frozen=True, eq=False)
class TokenConstraints:
    """A request's ``allowed_token_ids`` and ``logit_bias`` as tensors on the logits' device,
    the ids past the vocabulary dropped (``Sequence.token_constraints``): built on its first
    step (``_constraints``) with one host -> device copy per kind, then reused by every step
    while its ``params``, ``vocab`` and ``device`` stay the same.

    Regression (review 27c F3): ``apply_token_constraints`` rebuilt Python lists of every
    entry of every asking row on every step: ~1.4 ms per row per step at the bounds (4,096
    of each), 93 ms per step at 64 rows."""

    params: SamplingParams
    vocab: int
    device: torch.device
    allowed: torch.Tensor  # long: the allowed ids (empty when it has none: see the params)
    bias_ids: torch.Tensor  # long: the biased ids
    bias_values: torch.Tensor  # float32: their biases, in the same order


def _build_constraints(params: SamplingParams, vocab: int, device: torch.device) -> TokenConstraints:
    allowed = bias_ids = torch.empty(0, dtype=torch.long, device=device)
    bias_values = torch.empty(0, dtype=torch.float32, device=device)
    if params.allowed_token_ids is not None:
        allowed = torch.tensor([t for t in params.allowed_token_ids if t < vocab], dtype=torch.long).to(device)
    if params.logit_bias:
        pairs = [p for p in params.logit_bias if p[0] < vocab]
        # ids and biases in one float64 copy (the ids, at most MAX_SAMPLING_TOKEN_ID, are exact)
        packed = torch.tensor([[t for t, _ in pairs], [b for _, b in pairs]], dtype=torch.float64).to(device)
        bias_ids, bias_values = packed[0].long(), packed[1].float()
    return TokenConstraints(params, vocab, device, allowed, bias_ids, bias_values)


def _constraints(seq: Sequence, vocab: int, device: torch.device) -> TokenConstraints:
    """``seq``'s ``TokenConstraints``, built on first use and kept on it."""
    cached = seq.token_constraints
    if cached is None or cached.params is not seq.sampling_params or cached.vocab != vocab or cached.device != device:
        cached = seq.token_constraints = _build_constraints(seq.sampling_params, vocab, device)
    return cached


def apply_token_constraints(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``logits`` after each row's ``allowed_token_ids`` mask (every other token -inf) and then
    its ``logit_bias`` (added to its tokens' logits); ``logits`` itself when no row asks for
    either (the default costs one pass over the rows' parameters). The first two of vLLM V1's
    logits steps after the raw log probabilities (its allowed-token mask and
    ``LogitBiasLogitsProcessor``); a request's ids lie in the vocabulary (``LLMEngine``
    refuses others), an id past it here is dropped.

    Cost, per step: each asking request's ids and biases are copied host -> device once, on
    its first step (``TokenConstraints``); a step concatenates the asking rows' tensors on the
    device (``_entries``: no per-entry Python) and scatters them in one op per kind; the
    allowed rows' mask is one (rows, vocab) boolean."""
    allowed = [i for i, seq in enumerate(seqs) if seq.sampling_params.allowed_token_ids is not None]
    biased = [i for i, seq in enumerate(seqs) if seq.sampling_params.logit_bias]
    if not (allowed or biased):
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[1], logits.device
    if allowed:
        ids = [_constraints(seqs[i], vocab, device).allowed for i in allowed]
        rows, cols = _entries(list(range(len(allowed))), ids, device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
        keep.view(-1)[rows * vocab + cols] = True
        if len(allowed) == len(seqs):  # every row: in place, no gather and put back
            logits.masked_fill_(~keep, float("-inf"))
        else:
            index = torch.tensor(allowed, dtype=torch.long, device=device)
            logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if biased:
        built = [_constraints(seqs[i], vocab, device) for i in biased]
        rows, cols = _entries(biased, [c.bias_ids for c in built], device)
        bias = torch.cat([c.bias_values for c in built])
        # (ids are unique per row: no two adds to one cell, so the order of the adds is moot)
        logits.view(-1).index_add_(0, rows * vocab + cols, bias)
    return logits


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """``logits`` after each row's repetition, frequency and presence penalties and its
    ``min_tokens`` mask; ``logits`` itself when no row asks for any (the default costs one
    pass over the rows' parameters).

    - repetition (CTRL; vLLM's and transformers' ``RepetitionPenaltyLogitsProcessor``): over
      the prompt and output tokens, a positive logit is divided by the penalty, a negative
      one multiplied;
    - frequency and presence (OpenAI's): over the output tokens only,
      ``logit -= frequency * count + presence * (count > 0)``;
    - ``min_tokens``: while a row has generated fewer, its stop token ids and (unless
      ``ignore_eos``) the model's EOS ids are -inf (vLLM's ``MinTokensLogitsProcessor``).
    """
    rep, pen, masked = [], [], []
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if params.repetition_penalty != 1.0:
            rep.append(i)
        if params.presence_penalty or params.frequency_penalty:
            pen.append(i)
        if len(seq.output_token_ids) < params.min_tokens:
            masked.append(i)
    if not (rep or pen or masked):
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[1], logits.device
    if rep:
        seen = _seen([seqs[i].prompt_token_ids + seqs[i].output_token_ids for i in rep], vocab, device, counts=False)
        penalty = torch.tensor([seqs[i].sampling_params.repetition_penalty for i in rep], device=device)[:, None]
        rows = torch.tensor(rep, dtype=torch.long, device=device)
        sub = logits[rows]
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[rows] = torch.where(seen, penalized, sub)
    if pen:
        count = _seen([seqs[i].output_token_ids for i in pen], vocab, device, counts=True)
        params = [seqs[i].sampling_params for i in pen]
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        rows = torch.tensor(pen, dtype=torch.long, device=device)
        logits[rows] -= frequency * count + presence * (count > 0).float()
    if masked:
        cells = []
        for i in masked:
            params = seqs[i].sampling_params
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            cells.extend((i, t) for t in stops if 0 <= t < vocab)
        if cells:
            index = torch.tensor(cells, dtype=torch.long, device=device)
            logits[index[:, 0], index[:, 1]] = float("-inf")
    return logits


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Every logit under the ``top_k``-th largest set to -inf; (V,) -> (V,). 0, or a
    ``top_k`` at least the vocabulary, keeps all (vLLM clamps it so). Ties at the k-th value
    are all kept (as transformers' ``TopKLogitsWarper``)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def min_p_filter(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Every logit whose probability (softmax of ``logits``) is under ``min_p`` times the
    largest set to -inf; (V,) -> (V,). 0 keeps all; the most probable token is always kept.
    vLLM's ``MinPLogitsProcessor``, applied to the temperature-scaled logits, before top-k and
    top-p (Nguyen et al., "Turning Up the Heat: Min-p Sampling", 2024)."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    return logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of tokens whose mass reaches ``top_p``; (V,) -> (V,).
    The most probable token is always kept (vLLM's ``apply_top_k_top_p`` keeps "at least
    one"), so any ``top_p`` in (0, 1] leaves a distribution to draw from.

    No host sync (no boolean indexing): the kept sorted probabilities are scattered back.
    Source: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR'20), §3.1.

    Regression (oairev20 O7): a ``top_p`` under float32's smallest value (5e-324, valid in
    the HTTP API) compared as 0 against the float32 masses, kept no token, and the 0/0 row
    failed the draw: the request ended INTERNAL (HTTP 500).
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    keep[0] = True
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    return filtered / filtered.sum()


def sample(
    logits: torch.Tensor,
    seqs: list[Sequence],
    failed: list[int] | None = None,
    eos_token_ids: Collection[int] = (),
) -> list[int]:
    """The token ids of ``draw`` (its log probabilities left out)."""
    return draw(logits, seqs, failed, eos_token_ids)[0]


def draw(
    logits: torch.Tensor,
    seqs: list[Sequence],
    failed: list[int] | None = None,
    eos_token_ids: Collection[int] = (),
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Pick one token per row, with the log probabilities of the rows that ask.

    Args:
        logits: (num_seqs, vocab_size) float32, on any device.
        seqs: the row's sequences (their ``sampling_params`` and ``generator``, which lives
            on ``logits``' device).
        failed: given, a row whose draw fails is appended to it (its token is then
            meaningless) and the other rows are still drawn, instead of raising.
        eos_token_ids: the model's EOS ids, which ``min_tokens`` masks.

    Returns:
        num_seqs token ids: after each row's ``allowed_token_ids`` and ``logit_bias``
        (``apply_token_constraints``), then its penalties and ``min_tokens`` mask
        (``apply_penalties``), argmax for greedy rows; for the others, one draw from
        softmax(logits / temperature) after min-p, top-k and top-p filtering, with the
        sequence's generator. And per row its ``TokenLogprobs`` (the chosen token's log
        probability and the ``logprobs`` most probable tokens', of the raw logits:
        ``token_logprobs``) when its request asks for them, else None.

    Raises:
        SequenceFault: without ``failed``, a sampled row's draw failed (e.g. non-finite
            logits); names its request.
    """
    if not seqs:
        return [], []
    raw = logits
    logits = apply_penalties(apply_token_constraints(logits, seqs), seqs, eos_token_ids)
    tokens = logits.argmax(dim=-1)
    asking: list[int] = []
    for i, seq in enumerate(seqs):
        params = seq.sampling_params
        if params.logprobs is not None:
            asking.append(i)
        if params.greedy:
            continue
        try:
            scaled = top_k_filter(min_p_filter(logits[i] / params.temperature, params.min_p), params.top_k)
            probs = top_p_filter(torch.softmax(scaled, dim=-1), params.top_p)
            tokens[i : i + 1] = torch.multinomial(probs, 1, generator=seq.generator)
        except Exception as exc:  # e.g. non-finite logits: this request's fault alone
            if failed is None:
                raise SequenceFault(seq.request_id) from exc
            failed.append(i)
    if not asking:
        return tokens.tolist(), [None] * len(seqs)
    ks = [seqs[i].sampling_params.logprobs or 0 for i in asking]
    packed = token_logprobs(raw, tokens, asking, max(ks))
    values = torch.cat([tokens.to(torch.float64), packed.flatten()]).tolist()  # the one host sync
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    width, top = packed.shape[1], (packed.shape[1] - 1) // 2
    for j, (i, k) in enumerate(zip(asking, ks)):
        row = values[len(seqs) + j * width: len(seqs) + (j + 1) * width]
        out[i] = TokenLogprobs(row[0], tuple(zip(map(int, row[1: 1 + k]), row[1 + top: 1 + top + k])))
    return [int(t) for t in values[: len(seqs)]], out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """Log probabilities of ``rows`` of ``logits`` (num_seqs, vocab), batched on its device:
    one log_softmax over those rows, the chosen ``tokens``' (num_seqs,) values gathered, and
    their ``k`` largest (at most the vocabulary) with their ids. Returns (len(rows), 1 + 2k')
    float64: per row the chosen token's log probability, the k' ids (exact as float64) and
    their log probabilities, most probable first (``torch.topk``'s order).

    A value that is not finite (a row whose logits hold NaN or +inf: its log_softmax is NaN)
    is -inf, what the gateway accepts for "no probability" (the API floors it at -9999.0):
    the alternatives are then the finite ones first. Regression (review 26c F5): a greedy row
    with such logits, served its tokens without logprobs, sent NaN with them, which the
    gateway refuses as a malformed event (UNAVAILABLE, blaming the node)."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    logprobs = torch.nan_to_num(logprobs, nan=-math.inf, posinf=-math.inf)
    chosen = logprobs.gather(1, tokens[index][:, None])
    k = min(k, logprobs.shape[1])
    if not k:
        return chosen.to(torch.float64)
    top = logprobs.topk(k, dim=-1)
    parts = (chosen, top.indices, top.values)  # each to float64 first: float32 loses ids past 2^24
    return torch.cat([part.to(torch.float64) for part in parts], dim=1)
