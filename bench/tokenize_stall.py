"""Event-loop stall while a long prompt is tokenized on a worker thread, as the gateway does
(``InferenceServicer.off_loop``): ``services.chat.encode_text`` beside the plain
``tokenizer(text).input_ids`` it replaced, measured in the same run.

``python -m bench.tokenize_stall [--chars N] [--repeats R]``: SmolLM2's tokenizer over N
characters of Wikipedia extracts; while it runs on a thread, an asyncio task sleeps 5 ms at a
time and records the longest extra wait of one tick (what every other tenant's stream on that
loop waits). Medians over R runs, the ratio of stalls, and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

from bench.common import emit_json
from services.chat import encode_text

TICK_S = 0.005


async def _stall_of(work: Callable[[], list[int]]) -> tuple[float, float, int]:
    """(longest extra tick wait s, wall s, tokens) of ``work`` on a worker thread."""
    done = asyncio.Event()

    async def probe() -> float:
        worst, last = 0.0, time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            worst, last = max(worst, now - last - TICK_S), now
        return worst

    ticker = asyncio.ensure_future(probe())
    t0 = time.perf_counter()
    ids = await asyncio.to_thread(work)
    wall = time.perf_counter() - t0
    done.set()
    return await ticker, wall, len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chars", type=int, default=600_000, help="prompt characters (default 600000)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each way (default 5)")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from cache_node.model_loader import resolve_model_dir
    from workloads.corpus import load_corpus

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    text = ""
    for article in load_corpus():
        text += article.extract + "\n"
        if len(text) >= args.chars:
            break
    text = text[: args.chars]
    ways = {
        "encode_text": lambda: encode_text(tokenizer, text),
        "tokenizer_call": lambda: tokenizer(text, add_special_tokens=False).input_ids,
    }
    assert ways["encode_text"]() == ways["tokenizer_call"](), "encode_text gives other ids"
    runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ways}
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        for name, work in ways.items():
            runs[name].append(asyncio.run(_stall_of(work)))
    result: dict[str, float] = {"chars": len(text), "tokens": runs["encode_text"][0][2]}
    print(f"{len(text)} characters, {result['tokens']:.0f} tokens, {args.repeats} runs each")
    print(f"{'way':>16} {'median stall ms':>16} {'median wall s':>14}")
    for name, rows in runs.items():
        stall = statistics.median(r[0] for r in rows) * 1000
        wall = statistics.median(r[1] for r in rows)
        print(f"{name:>16} {stall:>16.1f} {wall:>14.2f}")
        result[f"{name}_stall_ms"], result[f"{name}_wall_s"] = stall, wall
    result["stall_ratio"] = result["encode_text_stall_ms"] / max(result["tokenizer_call_stall_ms"], 1e-9)
    result["wall_ratio"] = result["encode_text_wall_s"] / result["tokenizer_call_wall_s"]
    print(f"encode_text / tokenizer_call: stall {result['stall_ratio']:.2f}x, wall {result['wall_ratio']:.2f}x")
    emit_json(result)


if __name__ == "__main__":
    main()
