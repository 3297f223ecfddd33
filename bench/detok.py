"""Per-step detokenization cost of one request on the cache node's step thread, against its
output's length: the node's incremental detokenizer (``cache_node.detokenizer``) beside the
whole-output decode it replaced.

``python -m bench.detok [--tokens N]``: an output of N tokens (SmolLM2's tokenizer over
Wikipedia extracts with CJK and emoji lines mixed in) fed one token per step; the cost of a
step near 512, 2048 and 8000 output tokens (the mean over ``--window`` steps ending there) and
the total over the whole output. Ends with one JSON line (``bench.common.emit_json``).
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from bench.common import emit_json
from cache_node.detokenizer import INCOMPLETE, IncrementalDetokenizer

MIXED = "漢字かな交じり文 😀 👩‍💻 Viššénď 🇨🇿 €\n"


def output_ids(tokenizer, n: int) -> list[int]:  # type: ignore[no-untyped-def]
    """``n`` token ids of English text with a mixed-script line every few paragraphs."""
    from workloads.corpus import load_corpus

    ids: list[int] = []
    for i, article in enumerate(load_corpus()):
        ids += tokenizer.encode(article.extract + "\n" + (MIXED if i % 3 == 0 else ""), add_special_tokens=False)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the corpus holds fewer than {n} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8000, help="output tokens (default 8000)")
    parser.add_argument("--window", type=int, default=200, help="steps averaged per point (default 200)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    decode = partial(tokenizer.decode, skip_special_tokens=True)
    ids = output_ids(tokenizer, args.tokens)
    points = [p for p in (512, 2048, 8000) if p <= len(ids)]

    detok, step_s, text = IncrementalDetokenizer(decode), [], []
    for k, token in enumerate(ids):
        t0 = time.perf_counter()
        text.append(detok.add([token], final=k == len(ids) - 1))
        step_s.append(time.perf_counter() - t0)
    assert "".join(text) == decode(ids), "the incremental text differs from the whole decode"

    result: dict[str, float] = {"tokens": len(ids), "incremental_total_s": sum(step_s)}
    print(f"{'output tokens':>14} {'incremental ms/step':>20} {'whole decode ms/step':>21}")
    for p in points:
        inc = sum(step_s[p - args.window:p]) / args.window
        t0 = time.perf_counter()
        for _ in range(20):
            decode(ids[:p]).rstrip(INCOMPLETE)  # what a step cost before
        whole = (time.perf_counter() - t0) / 20
        print(f"{p:>14} {inc * 1000:>20.4f} {whole * 1000:>21.3f}")
        result[f"incremental_ms_at_{p}"] = inc * 1000
        result[f"whole_decode_ms_at_{p}"] = whole * 1000
    print(f"whole output of {len(ids)} tokens: {sum(step_s) * 1000:.0f} ms of step-thread time, incremental")
    emit_json(result)


if __name__ == "__main__":
    main()
