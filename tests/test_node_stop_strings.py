"""Stop strings enforced on the cache node, where it detokenizes (issue 20), with the real model
and no Ray: the text is cut before the stop string, the request ends at the token that
completed it with finish_reason "stop", and a session's history ends with that token."""

from __future__ import annotations

import asyncio

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.stop_strings import StopMatcher
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)
NEW = (504, 3575, 28, 614)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def node():
    n = CacheNode("stops", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def run(node: CacheNode, rid: str, tokens: tuple[int, ...] = PROMPT, stop: tuple[str, ...] = (),
        max_tokens: int = MAX_TOKENS, session_id: str = "", min_tokens: int = 0) -> dict:
    """One request through ``CacheNode.generate``: its events, text and token ids."""
    req = NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", token_ids=tokens, session_id=session_id,
                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop,
                                              min_tokens=min_tokens))

    async def collect() -> list[dict]:
        return [event async for event in node.generate(req)]

    events = asyncio.run(collect())
    deltas = [e for e in events if e["type"] == "delta"]
    return {"events": events, "text": "".join(e["text"] for e in deltas),
            "tokens": [t for e in deltas for t in e["token_ids"]], "finished": events[-1]}


@pytest.fixture(scope="module")
def free(node) -> dict:
    """The prompt's greedy continuation without stop strings, and a stop string from its middle
    (its first occurrence) with the number of tokens whose text first contains it."""
    out = run(node, "free")
    text = out["text"]
    start = next(i for i in range(len(text) // 3, len(text) - 3)
                 if text[i:i + 3].strip() and text.index(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    upto = next(k for k in range(1, len(out["tokens"]) + 1)
                if stop in node.tokenizer.decode(out["tokens"][:k], skip_special_tokens=True))
    assert 1 < upto < MAX_TOKENS
    return {**out, "stop": stop, "cut": text[:start], "upto": upto}


def test_stop_string_cuts_the_text_and_ends_the_request_at_its_token(node, free) -> None:
    out = run(node, "cut", stop=(free["stop"],))
    assert out["text"] == free["cut"] and free["stop"] not in out["text"]
    assert out["tokens"] == free["tokens"][:free["upto"]]  # no token after the one completing it
    assert out["finished"]["finish_reason"] == "stop" and out["finished"]["completion_tokens"] == free["upto"]


def test_session_history_ends_at_the_stop_token(node, free) -> None:
    """Regression: the stop string was cut at the gateway, which aborted the request; the
    node's session kept tokens the client never saw (or the whole turn was dropped). The next
    turn's prompt is the first prompt + the tokens up to the stop + the new message, not more."""
    first = run(node, "s-1", stop=(free["stop"],), session_id="sess")
    assert first["finished"]["finish_reason"] == "stop"
    assert node.engine.session_history("sess") == list(PROMPT) + free["tokens"][:free["upto"]]
    second = run(node, "s-2", tokens=NEW, max_tokens=2, session_id="sess")
    assert second["events"][0]["prompt_tokens"] == len(PROMPT) + free["upto"] + len(NEW)
    assert len(node.engine.session_history("sess")) == len(PROMPT) + free["upto"] + len(NEW) + 2


def test_stop_completed_by_the_last_token_still_says_stop(node, free) -> None:
    out = run(node, "last", stop=(free["stop"],), max_tokens=free["upto"])
    assert out["text"] == free["cut"] and out["finished"]["finish_reason"] == "stop"


def test_a_held_back_tail_is_sent_when_the_request_ends(node, free) -> None:
    """The text's end looked like a stop string's start: it is held back, then sent at the end."""
    stop = free["text"][-2:] + "\u2603\u2603"
    out = run(node, "tail", stop=(stop,))
    assert out["text"] == free["text"] and out["finished"]["finish_reason"] == "length"
    assert out["events"][-2] == {"type": "delta", "token_ids": [], "text": free["text"][-2:]}


def test_a_character_split_over_tokens_is_streamed_whole(node) -> None:
    """Regression: "ď" is two tokens whose first decodes as U+FFFD; the stream sent that
    replacement character, then only what followed it, so the client's text read "Višš�n..."
    though the token ids decoded to "Viššénď"."""
    from types import SimpleNamespace

    from cache_node.detokenizer import INCOMPLETE
    from services.cache_node_streams import _Stream

    text = "Viššénď 😀 (Czech)"
    ids = node.tokenizer.encode(text, add_special_tokens=False)
    assert any(INCOMPLETE in node.tokenizer.decode(ids[:k]) for k in range(1, len(ids)))  # splits exist
    req = NodeRequest(request_id="u", tenant="t", cache_namespace="ns", token_ids=PROMPT,
                      sampling=SamplingParams(max_tokens=len(ids)))
    stream = _Stream(None, None, req, len(PROMPT))
    deltas = []
    for token in ids:
        out = SimpleNamespace(request_id="u", new_token_ids=[token], finished=False, finish_reason=None,
                              logprobs=None, prompt_logprobs=())
        deltas += [e["text"] for e in node._events(out, stream) if e["type"] == "delta"]
    assert "".join(deltas) == text and not any(INCOMPLETE in d for d in deltas)


def test_a_step_decodes_a_few_tokens_however_long_the_output(node) -> None:
    """Regression: each step decoded the request's whole output again to find its new text,
    on the step thread (18.4 ms per step per request at 8,000 tokens); a step now decodes the
    last few tokens, and the text is still the whole output's decode."""
    from types import SimpleNamespace

    from services.cache_node_streams import _Stream

    real, lengths = node.tokenizer, []

    class Counting:
        def decode(self, ids, **kwargs):  # type: ignore[no-untyped-def]
            lengths.append(len(ids))
            return real.decode(ids, **kwargs)

    text = "The quick brown fox jumps over the lazy dog. 漢字 😀 " * 40
    ids = real.encode(text, add_special_tokens=False)
    req = NodeRequest(request_id="long", tenant="t", cache_namespace="ns", token_ids=PROMPT,
                      sampling=SamplingParams(max_tokens=len(ids)))
    stream, deltas = _Stream(None, None, req, len(PROMPT)), []
    node.tokenizer = Counting()
    try:
        for token in ids:
            out = SimpleNamespace(request_id="long", new_token_ids=[token], finished=False, finish_reason=None,
                                  logprobs=None, prompt_logprobs=())
            deltas += [e["text"] for e in node._events(out, stream) if e["type"] == "delta"]
    finally:
        node.tokenizer = real
    assert "".join(deltas) == text and len(ids) > 500
    assert max(lengths) <= 6, max(lengths)


def test_no_stop_string_is_looked_for_in_the_first_min_tokens_tokens(node, free) -> None:
    """vLLM's detokenizer searches for stop strings only in the text after the first
    ``min_tokens`` tokens' (review 25b N4): with ``min_tokens`` at the token completing the
    stop string, the request goes on past it (the text keeps it) and ends as without stop
    strings, unless the stop string comes again later."""
    out = run(node, "min", stop=(free["stop"],), min_tokens=free["upto"])
    assert out["text"].startswith(free["cut"] + free["stop"]) and len(out["tokens"]) > free["upto"]
    assert out["tokens"] == free["tokens"][:len(out["tokens"])]
    again = free["stop"] in free["text"][len(free["cut"]) + len(free["stop"]):]
    assert again or (out["text"] == free["text"] and out["finished"]["finish_reason"] == "length")
    before = run(node, "min-1", stop=(free["stop"],), min_tokens=free["upto"] - 1)
    assert before["text"] == free["cut"] and before["finished"]["finish_reason"] == "stop"


def test_a_matcher_that_does_not_search_sends_everything_held() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.feed("abcEN") == "abc"  # "EN" held: it may begin END
    assert matcher.feed("D x", search=False) == "END x" and not matcher.stopped
    assert matcher.feed("yEND") == "y" and matcher.stopped
