"""``stream_options`` served end to end (the real node, scheduler, gateway and HTTP API of
``test_logprobs_served``, no Ray): OpenAI's ``include_obfuscation`` (every chunk event padded
with random characters to a bucket of ``OBFUSCATION_BUCKET_CHARS``, by default) and vLLM's
``continuous_usage_stats`` (with ``include_usage``: each chunk's usage so far).

Regression (s40 new-user trial): both fields were refused 400 "unsupported field".
"""

from __future__ import annotations

import json
import re
import time
import timeit
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from services.openai_api.stream_shape import OBFUSCATION_BUCKET_CHARS, StreamShape, obfuscation
from tests.test_logprobs_served import PROMPT, Served

B = OBFUSCATION_BUCKET_CHARS


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def _events(s: Served, path: str, body: dict[str, Any]) -> list[str]:
    """A stream's ``data:`` payloads as sent (``[DONE]`` checked last, left out)."""
    req = urllib.request.Request(f"{s.base}{path}", json.dumps({"model": s.model, "stream": True, **body}).encode(),
                                 {"Authorization": f"Bearer {s.key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        lines = [line[len("data: "):] for line in resp.read().decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return lines[:-1]


BODIES = [("/chat/completions", {"messages": [{"role": "user", "content": "Say something long."}]}),
          ("/completions", {"prompt": PROMPT})]


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize("options", [None, {"include_obfuscation": True}, {"include_usage": True}])
def test_every_chunk_event_is_padded_to_a_bucket_by_default(served: Served, path: str, body: dict[str, Any],
                                                            options: dict[str, Any] | None) -> None:
    """Without ``include_obfuscation: false`` each chunk event (usage chunk included) ends with
    ``"obfuscation"``: random letters and digits whose length puts the event's JSON one bucket
    above its unpadded length rounded down to a bucket, plus a random part under a bucket."""
    extra = {} if options is None else {"stream_options": options}
    events = _events(served, path, {**body, "max_tokens": 8, "ignore_eos": True, "n": 2, **extra})
    pads = []
    for event in events:
        chunk = json.loads(event)
        pad = chunk.pop("obfuscation")
        assert re.fullmatch(r"[A-Za-z0-9]+", pad), event
        assert event == json.dumps({**chunk, "obfuscation": pad}, separators=(",", ":"))  # last, top-level
        plain = len(event) - len(pad)  # the event's JSON with an empty obfuscation
        assert len(event) // B == plain // B + 1, (len(event), plain)
        pads.append(len(event) % B)
    assert len(events) >= 8 and len(set(pads)) > 1, pads  # the random part differs between events
    assert ("usage" in json.loads(events[-1]) and json.loads(events[-1])["choices"] == []) == bool(extra.get(
        "stream_options", {}).get("include_usage"))


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_include_obfuscation_false_sends_no_padding(served: Served, path: str, body: dict[str, Any]) -> None:
    events = _events(served, path, {**body, "max_tokens": 4, "stream_options": {"include_obfuscation": False,
                                                                                "include_usage": True}})
    assert events and all("obfuscation" not in json.loads(e) for e in events)
    assert all(e == json.dumps(json.loads(e), separators=(",", ":")) for e in events)


def test_the_padding_is_random_and_fills_its_bucket() -> None:
    """``obfuscation``'s lengths over many draws: each of a bucket's residues, always within
    [1, 2B - 1], and the padded length one bucket past the plain one rounded down."""
    for plain in (0, 1, B - 1, B, 1000):
        lengths = {len(obfuscation(plain)) for _ in range(2000)}
        assert {(plain + n) % B for n in lengths} == set(range(B)), plain
        assert all((plain + n) // B == plain // B + 1 for n in lengths)
        assert min(lengths) >= 1 and max(lengths) <= 2 * B - 1
    assert len({obfuscation(7) for _ in range(200)}) > 190  # characters drawn anew each time


@pytest.mark.parametrize(("path", "body"), BODIES)
@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_puts_each_choices_counts_so_far_on_every_chunk(
        served: Served, path: str, body: dict[str, Any], n: int) -> None:
    """As vLLM's: with ``include_usage`` and ``continuous_usage_stats`` each chunk's ``usage``
    is its choice's prompt tokens and completion tokens so far (0 on a chat's role chunk,
    rising, the choice's whole count on its finish chunk); the last chunk is the usage chunk of
    the whole request."""
    events = [json.loads(e) for e in _events(served, path, {
        **body, "max_tokens": 6, "ignore_eos": True, "n": n,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}})]
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6 * n
    prompt = last["usage"]["prompt_tokens"]
    seen: dict[int, list[int]] = {i: [] for i in range(n)}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        seen[choice["index"]].append(usage["completion_tokens"])
        if choice["finish_reason"] is not None:
            assert usage["completion_tokens"] == 6, chunk
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 6 and counts[0] < 6, seen
        if path == "/chat/completions":
            assert counts[0] == 0  # the role chunk


@pytest.mark.parametrize("options", [{"continuous_usage_stats": True}, {"continuous_usage_stats": False}])
def test_continuous_usage_stats_without_include_usage_adds_nothing(served: Served, options: dict[str, Any]) -> None:
    """As vLLM's: continuous usage only with ``include_usage``; without it no chunk has usage."""
    events = [json.loads(e) for e in _events(served, "/completions", {
        "prompt": PROMPT, "max_tokens": 3, "stream_options": {**options, "include_obfuscation": False}})]
    assert events and all("usage" not in e for e in events)


def test_stream_options_still_need_stream_true(served: Served) -> None:
    status, body = served.post("/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                "stream_options": {"include_obfuscation": False}})
    assert status == 400 and body["error"]["param"] == "stream_options", body


def test_padding_costs_little_next_to_the_event_itself() -> None:
    """The padding is drawn on every streamed chunk by default, on the API's event loop: a
    padded event costs at most 3 times an unpadded one in this thread's CPU time (best of 7
    rounds each: neither a loaded host nor the served stack's threads holding the GIL count).
    Regression (s40 diff review r6 of 7a4f038): one ``secrets.choice`` per padding character
    made a padded text chunk ~10 times as costly (~57 us against ~5 us)."""
    chunk = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1700000000,
             "model": "tiny", "choices": [{"index": 0, "finish_reason": None, "logprobs": None,
                                           "delta": {"content": " hello"}}]}
    padded, plain = StreamShape(), StreamShape(obfuscate=False)
    cost = {name: min(timeit.Timer(lambda shape=shape: shape.event(dict(chunk)), timer=time.thread_time).repeat(
                repeat=7, number=2000))
            for name, shape in (("padded", padded), ("plain", plain))}
    assert cost["padded"] <= 3 * cost["plain"], cost
