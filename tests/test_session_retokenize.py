"""A session's next turn has token for token the prompt of the same conversation sent without
the session, however its last turn ended.

Regression (review 30a F2): a turn's history kept the tokens the model generated, while a
request without the session sends the reply's text, which the chat template tokenizes anew:
SmolLM2 generates "\\n\\n" as one token (``ĊĊ``, 2,697... whichever id) that encodes as two
("\\n", "\\n"), so 2 of 6 two-turn greedy conversations had other prompts (107 tokens against
108) and other answers. Now the history holds the reply as the rendering's tokens
(``Streams._cut_to_rendering``): the output's longest prefix that is those tokens stays, with
its KV, and the rest is replaced by them.

The real model on the real CacheNode (fp32 CPU), the reviewer's l5_retokenize conversations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.sampling_params import SamplingParams
from services.cache_node import CacheNode
from services.cache_node_streams import rendering_cut
from services.config import NodeConfig
from services.node_request import NodeRequest
from tests.conftest import make_engine
from tests.test_session_stop_cut import chat
from tests.test_tier_engine import prompt_of

QUESTIONS = ["List three fruits.", "Give two tips for sleeping well.", "Name four planets.",
             "Write two short lines about the sea.", "List three colors of the rainbow.",
             "Name three European capitals."]
FOLLOW = {"role": "user", "content": "Now say the second item again, in one word."}


@pytest.fixture(scope="module")
def node() -> Iterator[CacheNode]:
    # (room for every conversation of the module at once: ``conversations`` runs them together)
    n = CacheNode("t", NodeConfig(kv_pool_bytes=160 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


async def _events(node: CacheNode, req: NodeRequest) -> tuple[str, dict[str, Any], list[int]]:
    events = [ev async for ev in node.generate(req)]
    assert events[-1]["type"] == "finished", events[-1]
    return ("".join(ev["text"] for ev in events if ev["type"] == "delta"), events[-1],
            [t for ev in events if ev["type"] == "delta" for t in ev["token_ids"]])


def run_tokens(node: CacheNode, req: NodeRequest) -> tuple[str, dict[str, Any], list[int]]:
    """``run``, and the output's token ids."""
    return asyncio.run(_events(node, req))


def run_together(node: CacheNode, reqs: list[NodeRequest]) -> list[tuple[str, dict[str, Any], list[int]]]:
    """``run_tokens`` of every request, sent at once (the node batches them: on the CPU a step
    of n sequences costs little more than one of a single sequence)."""
    async def go() -> list[tuple[str, dict[str, Any], list[int]]]:
        return list(await asyncio.gather(*(_events(node, req) for req in reqs)))

    return asyncio.run(go())


Turns = dict[str, tuple[str, dict[str, Any], list[int], str, dict[str, Any], str, dict[str, Any], list[int]]]
"""Per session id: turn 1's text, end and token ids; turn 2's text and end; the stateless
conversation's text and end; the session's history right after turn 2."""


def two_turns_of(node: CacheNode, convs: dict[str, tuple[str, int, tuple[str, ...]]]) -> Turns:
    """Turn 1 and 2 of each session ``sid`` (``convs``: sid -> question, turn 1's max_tokens,
    its stop strings), and each conversation sent without the session: all turns 1 at once,
    then all turns 2 and stateless conversations at once."""
    users = {sid: {"role": "user", "content": question} for sid, (question, _, _) in convs.items()}
    firsts = run_together(node, [chat(f"{sid}/1", [users[sid]], sid=sid, stop=stop, max_tokens=max_tokens)
                                 for sid, (_, max_tokens, stop) in convs.items()])
    reqs = []  # (turn 2's prompt is checked token for token; 8 tokens of its answer compared)
    for sid, (reply, _, _) in zip(convs, firsts):
        reqs.append(chat(f"{sid}/2", [FOLLOW], sid=sid, max_tokens=8))
        reqs.append(chat(f"{sid}/alone", [users[sid], {"role": "assistant", "content": reply}, FOLLOW],
                         max_tokens=8))
    seconds = run_together(node, reqs)
    return {sid: (*firsts[i], *seconds[2 * i][:2], *seconds[2 * i + 1][:2], node.engine.session_history(sid))
            for i, sid in enumerate(convs)}


def two_turns(node: CacheNode, turns: Turns, sid: str, question: str) -> tuple[str, dict[str, Any], bool]:
    """Asserts session ``sid``'s turn 2 (``two_turns_of``) had the prompt and greedy answer of
    the conversation sent without the session. Returns turn 1's text and end, and whether its
    output's tokens were not the rendering's (the history was cut)."""
    reply, first, generated, answer, second, stateless, alone, history = turns[sid]
    user = {"role": "user", "content": question}
    templater = node.templater
    prompt = templater.first_turn([user])
    whole = templater.first_turn([user, {"role": "assistant", "content": reply}, FOLLOW])
    assert second["prompt_tokens"] == alone["prompt_tokens"] == len(whole)
    assert history[: len(whole)] == whole
    assert answer == stateless, (question, answer, stateless)
    assert not node.engine.check_integrity()
    return reply, first, generated != whole[len(prompt): len(prompt) + len(generated)]


SLEEP = "Give two tips for sleeping well."
BRIEFLY = "Give two tips for sleeping well, briefly."
ENDS = {"eos": (BRIEFLY, 400, ()), "length": (SLEEP, 40, ()), "length_at_the_newlines": (SLEEP, 32, ()),
        "stop_string": (SLEEP, 48, (" Restful",))}
"""``test_every_end_of_a_turn_continues_as_the_stateless_conversation``'s turn 1: question,
max_tokens and stop strings. (``SLEEP``'s 32nd token is "\\n\\n"; ``BRIEFLY``'s reply holds
"\\n\\n" and ends by EOS at 61 tokens, ``SLEEP``'s at 76: the conversations' turns 1 run
together, as many steps as the longest.)"""


@pytest.fixture(scope="module")
def conversations(node: CacheNode) -> Turns:
    """Both tests' two-turn conversations, run together (``two_turns_of``)."""
    convs = {f"rt-{i}": (question, 48, ()) for i, question in enumerate(QUESTIONS)}
    convs.update({f"end-{how}": end for how, end in ENDS.items()})
    return two_turns_of(node, convs)


def test_a_sessions_next_turn_has_the_stateless_prompt_and_answer(node: CacheNode, conversations: Turns) -> None:
    """Failed on the old code: 'Give two tips for sleeping well.' and 'Write two short lines
    about the sea.' replied with "\\n\\n" generated as one token; their session's turn 2 had a
    prompt a token shorter than the stateless one and another answer."""
    cut = []
    for i, question in enumerate(QUESTIONS):
        reply, _, retokenized = two_turns(node, conversations, f"rt-{i}", question)
        if retokenized:
            cut.append(question)
            assert "\n\n" in reply
    assert cut, "no reply's tokens differed from its rendering's: the test tests nothing"


@pytest.mark.parametrize("how", ["eos", "length", "length_at_the_newlines", "stop_string"])
def test_every_end_of_a_turn_continues_as_the_stateless_conversation(
        node: CacheNode, conversations: Turns, how: str) -> None:
    """A reply holding "\\n\\n" (as the model generated it) ended by EOS, by max_tokens (past the
    "\\n\\n", or right at it), or by a stop string past it ("2. **Creating a" kept)."""
    reply, first, retokenized = two_turns(node, conversations, f"end-{how}", ENDS[how][0])
    if how == "eos":
        assert first["finish_reason"] == "stop" and not reply.endswith("\ufffd")
    elif how.startswith("length"):
        assert first["finish_reason"] == "length"
    else:
        assert first["finish_reason"] == "stop"
    # a reply ending with "\n\n" has it as one token in the rendering too (before <|im_end|>)
    assert "\n\n" in reply and retokenized == (how != "length_at_the_newlines")


def test_a_cut_into_the_prompts_lead_is_checked(tiny: LoadedModel) -> None:
    """``SessionTable.cut_turn`` with a ``lead``: a negative ``keep`` cuts into the prompt's
    last tokens when the prompt ends with ``lead``; else nothing changes (False)."""
    eng: LLMEngine = make_engine(tiny, kv_pool_bytes=256 * 8192)
    p1 = prompt_of(30, 1)
    eng.add_request(p1, SamplingParams(max_tokens=5, ignore_eos=True), request_id="t1", session_id="s")
    while eng.has_unfinished_requests():
        out = [o for o in eng.step() if o.finished] or None
        if out:
            output = out[0].output_token_ids
    assert not eng.cut_session_turn("s", "t1", len(p1), output, -1, [7], lead=[p1[-1] + 1])
    assert eng.session_history("s") == p1 + list(output)
    assert not eng.cut_session_turn("s", "t1", len(p1), output, -3, [7], lead=p1[-2:])  # past the lead
    assert eng.cut_session_turn("s", "t1", len(p1), output, -1, [7, 8], lead=p1[-2:])
    assert eng.session_history("s") == p1[:-1] + [7, 8]
    assert not eng.check_integrity()


def test_special_tokens_inside_a_reply_leave_its_history(node: CacheNode) -> None:
    """Review 30i F4: a reply whose output holds <|im_end|> and <|im_start|> before its end
    (``ignore_eos``) kept them in the history, while the client's text skips them (turn 2: 76
    prompt tokens against 71, 'La lucha de la españa.' against 'The capital of Spain is Madrid.')."""
    question = {"role": "user", "content": "What is the capital of France?"}
    follow = {"role": "user", "content": "And of Spain?"}

    def ask(rid: str, messages: list[dict[str, str]], sid: str = "", **sampling: Any) -> NodeRequest:
        return NodeRequest(request_id=rid, tenant="t", cache_namespace="ns", session_id=sid,
                           messages=tuple(messages), sampling=SamplingParams(**sampling))

    reply, _, generated = run_tokens(node, ask("mid/1", [question], "mid", max_tokens=24, ignore_eos=True))
    specials = set(node.tokenizer.all_special_ids)
    assert any(t in specials for t in generated[:-1]), generated  # (the case tested)
    kept = [question, {"role": "assistant", "content": reply}]
    whole = node.templater.first_turn([*kept, follow])
    (answer, second, _), (stateless, _, _) = run_together(
        node, [ask("mid/2", [follow], "mid", max_tokens=12), ask("mid-alone", [*kept, follow], max_tokens=12)])
    assert second["prompt_tokens"] == len(whole) and node.engine.session_history("mid")[: len(whole)] == whole
    assert answer == stateless
    assert not node.engine.check_integrity()


@pytest.mark.parametrize("text", [
    "Cats are incredibly intelligent and social animals with a unique blend of feline characteristics.",
    "The Chihuahua's 3.14159 naïve café façade costs $12,345.67 (approx.) — 😀 ok!",
    "def f(x):\n    return x**2  # squared\n\n\nprint(f(12))",
    "\n\n  Leading blanks, then 1.\n\n2.",
])
def test_a_reply_cut_anywhere_reads_as_the_stateless_rendering(node: CacheNode, text: str) -> None:
    """Review 30i F5: a stop string cutting a reply inside a pre-token (a blank run, a word of
    several tokens) kept the output's tokens up to the cut and the rest tokenized alone, which
    is not the tokenization of the kept text (4 of 221 cut positions: 'The Chihua' as
    'ĠChihu', 'a' against 'ĠCh', 'ih'...). Every cut of each text (the output its canonical
    tokens, and its tokens with "\\n\\n" as single tokens split): the cut history's reply is
    the stateless rendering's."""
    templater = node.templater
    user = {"role": "user", "content": "hi"}
    prompt = templater.first_turn([user])
    lead = templater.reply_lead[1]
    assert prompt[-len(lead):] == lead
    canonical = tuple(templater.encode(text))
    for cut in range(len(text) + 1):
        kept = text[:cut]
        whole = templater.first_turn([user, {"role": "assistant", "content": kept}, {"role": "user", "content": "x"}])
        lead_, tokens = templater.reply_tokens(kept, eos=False)
        assert lead_ == lead
        plan = rendering_cut(lead, canonical, tokens)
        history = prompt + list(canonical) if plan is None else (prompt + list(canonical))[: len(prompt) + plan[0]] + plan[1]
        assert whole[: len(history)] == history and whole[len(history)] == templater.eos_token_id, kept
