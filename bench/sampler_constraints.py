"""``python -m bench.sampler_constraints [--quick] [--device cpu|cuda] [--repeats N]``: the
per-step cost of ``logit_bias`` and ``allowed_token_ids`` at their bounds (4,096 entries of each
per row) in ``cache_node.sampler.apply_token_constraints``, for 8, 64 and 256 rows of
SmolLM2's vocabulary (49,152), next to a reference that rebuilds every row's entries as
Python lists each step (the sampler before review 27c F3), measured in the same run and
interleaved. Each request's tensors are built on its first step (a warm-up step, not timed),
as in the engine. Prints median ms per step and ``ratio`` = new / reference; the last line is
one JSON object."""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import emit_json, median
from cache_node.sampler import apply_token_constraints
from cache_node.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS_TOKENS, SamplingParams
from cache_node.sequence import Sequence

VOCAB = 49_152


def list_rebuild_reference(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """``apply_token_constraints`` as it was before review 27c F3: every step flattens every
    asking row's ids and biases into Python lists and copies them host -> device."""
    def entries(rows: list[int], columns: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        counts = torch.tensor([len(c) for c in columns])
        index = torch.stack([torch.repeat_interleave(torch.tensor(rows), counts),
                             torch.tensor([t for c in columns for t in c], dtype=torch.long)]).to(device)
        return index[0], index[1]

    allowed = [i for i, seq in enumerate(seqs) if seq.sampling_params.allowed_token_ids is not None]
    biased = [i for i, seq in enumerate(seqs) if seq.sampling_params.logit_bias]
    if not (allowed or biased):
        return logits
    logits = logits.float().clone()
    vocab, device = logits.shape[1], logits.device
    if allowed:
        ids = [[t for t in seqs[i].sampling_params.allowed_token_ids or () if t < vocab] for i in allowed]
        rows, cols = entries(list(range(len(allowed))), ids, device)
        keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=device)
        keep[rows, cols] = True
        index = torch.tensor(allowed, dtype=torch.long, device=device)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    if biased:
        pairs = [[p for p in seqs[i].sampling_params.logit_bias if p[0] < vocab] for i in biased]
        rows, cols = entries(biased, [[t for t, _ in row] for row in pairs], device)
        bias = torch.tensor([b for row in pairs for _, b in row], dtype=torch.float32).to(device)
        logits[rows, cols] += bias
    return logits


def _params(rng: torch.Generator) -> SamplingParams:
    ids = torch.randperm(VOCAB, generator=rng)
    biases = torch.randn(MAX_LOGIT_BIAS_TOKENS, generator=rng).tolist()
    return SamplingParams(max_tokens=8, logit_bias=dict(zip(ids[:MAX_LOGIT_BIAS_TOKENS].tolist(), biases)),
                          allowed_token_ids=ids[-MAX_ALLOWED_TOKEN_IDS:].tolist())


def _step_ms(fn: object, logits: torch.Tensor, seqs: list[Sequence], device: torch.device) -> float:
    start = time.perf_counter()
    out = fn(logits, seqs)  # type: ignore[operator]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert out is not logits
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 and 64 rows, 5 steps")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per system and size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as bench.engine)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes, repeats = ((8, 64), 5) if args.quick else ((8, 64, 256), args.repeats)
    rng = torch.Generator().manual_seed(0)
    result: dict[str, object] = {"bench": "sampler_constraints", "device": str(device), "vocab": VOCAB,
                                 "entries_per_row": {"logit_bias": MAX_LOGIT_BIAS_TOKENS,
                                                     "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS}}
    print(f"{'rows':>5} {'new ms/step':>12} {'list-rebuild ms/step':>21} {'ratio':>7}")
    for rows in sizes:
        seqs = [Sequence(f"r{i}", [1, 2, 3], _params(rng)) for i in range(rows)]
        logits = torch.randn(rows, VOCAB, generator=rng).to(device)
        # warm-up, which builds the requests' tensors (their first step), and the same logits from both
        assert torch.equal(apply_token_constraints(logits, seqs), list_rebuild_reference(logits, seqs))
        new, old = [], []
        for _ in range(repeats):  # interleaved: both see the same machine load
            new.append(_step_ms(apply_token_constraints, logits, seqs, device))
            old.append(_step_ms(list_rebuild_reference, logits, seqs, device))
        new_ms, old_ms = median(new), median(old)
        print(f"{rows:>5} {new_ms:>12.2f} {old_ms:>21.2f} {new_ms / old_ms:>7.3f}", flush=True)
        result[f"rows_{rows}"] = {"new_ms": round(new_ms, 3), "list_rebuild_ms": round(old_ms, 3),
                                  "ratio": round(new_ms / old_ms, 4)}
    emit_json(result)


if __name__ == "__main__":
    main()
