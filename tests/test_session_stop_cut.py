"""A session's history after a turn holds exactly the tokens of the reply its client got.

Regression: a session reply cut by a stop string kept the stop string's tokens (and the text
of its last token past the cut) in the session's history and KV, while the client and the
node's kept messages had the cut text; the next turn attended to tokens the client never saw
and answered otherwise than the same conversation sent without ``session_id`` (SmolLM2, greedy:
'Cats are incredibly intelligent and can be trained...' against 'Cats are incredibly ').

The real model on the real CacheNode (fp32 CPU); the stop strings are taken from the model's
own reply, so each cuts where it names: after a token, inside one, across several (their KV
computed), across a full cached block.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from tests.conftest import make_engine
from tests.test_session_rewind_state import drain
from tests.test_tier_engine import prompt_of

USER = {"role": "user", "content": "Tell me about cats."}
NEXT = {"role": "user", "content": "And dogs?"}


@pytest.fixture(scope="module")
def node() -> Iterator[CacheNode]:
    # (room for every conversation of ``stop_turns`` at once)
    n = CacheNode("t", NodeConfig(kv_pool_bytes=128 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


def chat(rid: str, messages: list[dict[str, str]], sid: str = "", stop: tuple[str, ...] = (), max_tokens: int = 40,
         policy: str = "") -> NodeRequest:
    return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", session_id=sid, policy=policy,
                       messages=tuple(messages), sampling=SamplingParams(max_tokens=max_tokens, stop=stop))


async def _events(node: CacheNode, req: NodeRequest) -> tuple[str, dict[str, Any]]:
    events = [ev async for ev in node.generate(req)]
    assert events[-1]["type"] == "finished", events[-1]
    return "".join(ev["text"] for ev in events if ev["type"] == "delta"), events[-1]


def run(node: CacheNode, req: NodeRequest) -> tuple[str, dict[str, Any]]:
    """The request's text and its ``finished`` event."""
    return asyncio.run(_events(node, req))


def run_all(node: CacheNode, reqs: list[NodeRequest]) -> list[tuple[str, dict[str, Any]]]:
    """``run`` of every request, sent at once (the node batches them: on the CPU a step of n
    sequences costs little more than one of a single sequence)."""
    async def go() -> list[tuple[str, dict[str, Any]]]:
        return list(await asyncio.gather(*(_events(node, req) for req in reqs)))

    return asyncio.run(go())


def stops(reply: str) -> dict[str, str]:
    """Stop strings cutting ``reply`` (SmolLM2's greedy answer to ``USER``) in each way."""
    words = reply.split(" ")
    assert len(words) > 16, reply
    return {
        "a_word": " " + words[3],  # the cut falls between tokens
        "inside_a_token": words[3][2:],  # the cut falls inside a token: its first letters are kept
        "several_tokens": " ".join(words[3:7]),  # their KV is computed
        "past_a_full_block": " ".join(words[3:18]),  # a cached full block holds tokens past the cut
    }


HOWS = ["a_word", "inside_a_token", "several_tokens", "past_a_full_block"]
POLICIES = ["", "snapkv-0.5"]


@pytest.fixture(scope="module")
def stop_turns(node: CacheNode) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (how, policy): the reference reply (one per policy: the same greedy request), the
    stop string, turn 1 of session ``s-{how}-{policy}`` cut by it (its text and end; the
    session's history and computed tokens after it), turn 2 (text and end) and, without a
    policy, the same conversation sent without the session (text). Each stage's requests run
    together (``run_all``)."""
    # (the reference needs its first 18 words: its 30 tokens hold 29; a turn 1 stops by word 18)
    refs = dict(zip(POLICIES, run_all(node, [chat(f"ref-{policy}", [USER], policy=policy, max_tokens=30)
                                             for policy in POLICIES])))
    cases = {(how, policy): {"reply": refs[policy][0], "stop": stops(refs[policy][0])[how], "sid": f"s-{how}-{policy}"}
             for policy in POLICIES for how in HOWS}
    firsts = run_all(node, [chat(f"{c['sid']}/1", [USER], sid=c["sid"], stop=(c["stop"],), policy=policy)
                            for (_, policy), c in cases.items()])
    reqs = []
    for ((how, policy), c), (cut, first) in zip(cases.items(), firsts):
        c.update(cut=cut, first=first, history=node.engine.session_history(c["sid"]),
                 computed=node.engine.sessions.sessions[c["sid"]].num_computed_tokens)
        reqs.append(chat(f"{c['sid']}/2", [NEXT], sid=c["sid"], policy=policy))
        if not policy:
            reqs.append(chat(f"alone-{how}", [USER, {"role": "assistant", "content": cut}, NEXT]))
    seconds = iter(run_all(node, reqs))
    for (_, policy), c in cases.items():
        c["answer"], c["second"] = next(seconds)
        if not policy:
            c["stateless"] = next(seconds)[0]
    return cases


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("policy", POLICIES)
def test_the_turn_after_a_stop_string_answers_as_the_conversation_without_a_session(
        node: CacheNode, stop_turns: dict[tuple[str, str], dict[str, Any]], how: str, policy: str) -> None:
    """Failed on the old code for every cut: the history kept the stop string's tokens (the
    session's next turn 'Cats are incredibly intelligent and can be trained...' where the same
    conversation without a session answers 'Cats are incredibly ')."""
    c = stop_turns[how, policy]
    reply, stop, sid, cut, first = c["reply"], c["stop"], c["sid"], c["cut"], c["first"]
    assert first["finish_reason"] == "stop" and cut == reply[: reply.index(stop)]
    templater = node.templater
    kept = [USER, {"role": "assistant", "content": cut}]
    prompt = templater.first_turn([USER])
    history, computed, answer, second = c["history"], c["computed"], c["answer"], c["second"]
    if not policy:  # (a compressing policy's turn continuing its history compresses otherwise than a
        # fresh prompt: its answer is not compared)
        assert answer == c["stateless"]
    # the history was the prompt, then the tokens of the cut reply alone, with KV for no other
    assert history[: len(prompt)] == prompt and node.tokenizer.decode(history[len(prompt):]) == cut
    assert computed <= len(history)
    whole = templater.first_turn([*kept, NEXT])  # the conversation sent without the session
    assert node.engine.session_history(sid)[: len(whole)] == whole and second["prompt_tokens"] == len(whole)
    assert not node.engine.check_integrity()


def test_a_turn_ended_by_its_stop_token_or_its_length_keeps_its_tokens(node: CacheNode) -> None:
    """Nothing is cut from a reply the client got whole: ended by EOS (kept as the history's
    close) or by max_tokens."""
    question = {"role": "user", "content": "What is the capital of France?"}  # 'The capital of France is Paris.'
    cases = (("whole-eos", 40), ("whole-length", 6))
    ends = run_all(node, [chat(f"{sid}/1", [question], sid=sid, max_tokens=max_tokens) for sid, max_tokens in cases])
    for (sid, max_tokens), (_, fin) in zip(cases, ends):
        history = node.engine.session_history(sid)
        assert len(history) == fin["prompt_tokens"] + fin["completion_tokens"]
        if max_tokens == 40:
            assert fin["finish_reason"] == "stop" and history[-1] == node.templater.eos_token_id
        sess = node.engine.sessions.sessions[sid]
        assert sess.num_computed_tokens == len(history) - 1


def test_reply_in_history_keeps_the_tokens_the_text_covers() -> None:
    """One character a token: what stays, what is tokenized anew, what goes."""
    from services.cache_node_streams import reply_in_history

    def decode(ids: list[int]) -> str:
        return "".join("" if t >= 100 else "\ufffd" if t == 99 else chr(ord("a") + t) for t in ids)

    def encode(text: str) -> list[int]:
        return [ord(c) - ord("a") if c != "\ufffd" else 98 for c in text]

    never = lambda _: False
    assert reply_in_history(decode, encode, (0, 1, 2), "abc", False, never) is None
    assert reply_in_history(decode, encode, (0, 1, 2, 3), "ab", True, never) == (2, [])  # a stop string "cd"
    assert reply_in_history(decode, encode, (0, 1, 2), "abc", True, never) is None  # stopped, nothing cut
    # a special token drawn as a stop token renders as nothing in the kept reply: it goes
    assert reply_in_history(decode, encode, (0, 1, 100), "ab", False, lambda t: t == 100) == (2, [])
    assert reply_in_history(decode, encode, (0, 100, 1, 2), "ab", True, lambda t: t == 100) == (3, [])
    # a last character cut in its bytes is tokenized anew
    assert reply_in_history(decode, encode, (0, 99), "a\ufffd", True, never) == (1, [98])


@pytest.mark.parametrize("cut_at", [40, 47, 48, 55])
def test_a_cut_history_keeps_kv_only_for_its_tokens(tiny: LoadedModel, cut_at: int) -> None:
    """The engine's cut (``LLMEngine.cut_session_turn``): blocks past the cut are freed, the one
    it falls in is dropped when cached (a full block: its slots past the cut would be written
    with other tokens' KV), and the next turn decodes as the same prompt on a fresh engine."""
    eng = make_engine(tiny, kv_pool_bytes=256 * 8192)
    p1 = prompt_of(30, 1)
    eng.add_request(p1, SamplingParams(max_tokens=30, ignore_eos=True), request_id="t1", session_id="s")
    out = drain(eng)["t1"].output_token_ids
    keep, tail = cut_at - len(p1), [5, 6, 7]
    assert eng.cut_session_turn("s", "t1", len(p1), out, keep, tail)
    assert not eng.cut_session_turn("s", "t1", len(p1), out, keep, tail)  # the history is not that turn's end
    sess = eng.sessions.sessions["s"]
    assert sess.token_ids == p1 + list(out[:keep]) + tail
    bs = eng.kv_manager.block_size
    # 40, 47: the cut falls in a full block (cached): it goes; 55: in the last one, partly computed: it stays
    assert sess.num_computed_tokens == (cut_at if cut_at % bs == 0 or cut_at >= 48 else cut_at // bs * bs)
    assert len(sess.blocks) == -(-sess.num_computed_tokens // bs)
    p2 = sess.token_ids + prompt_of(20, 3)
    eng.add_request(p2, SamplingParams(max_tokens=12, ignore_eos=True), request_id="t2", session_id="s")
    got = drain(eng)["t2"].output_token_ids
    assert not eng.check_integrity()
    fresh = make_engine(tiny, kv_pool_bytes=256 * 8192)
    fresh.add_request(p2, SamplingParams(max_tokens=12, ignore_eos=True), request_id="f")
    assert got == drain(fresh)["f"].output_token_ids


def test_a_cut_asked_before_the_turn_is_handed_over_is_made_then(tiny: LoadedModel) -> None:
    """A turn whose compaction was put off is handed to its session after the node asked for
    the cut (``Session.cut``): the history is cut then."""
    eng = make_engine(tiny, kv_pool_bytes=256 * 8192)
    p1 = prompt_of(30, 1)
    eng.add_request(p1, SamplingParams(max_tokens=10, ignore_eos=True), request_id="t1", session_id="s")
    eng.step()
    assert eng.cut_session_turn("s", "t1", len(p1), (), 0, [9])  # still the session's running turn
    drain(eng)
    assert eng.session_history("s") == p1 + [9]
    assert eng.sessions.sessions["s"].cut is None and not eng.check_integrity()
