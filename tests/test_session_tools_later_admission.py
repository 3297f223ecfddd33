"""Every session turn's tools count where a prompt's size is counted: admission counts a later
turn's tools unless they are the ones its session's history holds, and the gateway's size check
counts them for every turn.

A session turn's messages are rendered on its cache node; admission sees their size through the
gateway's estimates (``prompt_tokens_estimate``, ``prompt_tokens_tools``). A later turn with other
tools than its history's is rendered anew on the node, the tools written into the conversation
(``Requests._prompt``). Regression (F3): admission counted the tools of a session's first turn
only (``prompt_size``'s ``opens_session``), so a tenant could send a first turn without tools and
add thousands of tokens of them in its next turn, counted as 0 tokens against the TTFT estimate
and the prefill backlog; and the gateway's check that a turn can ever fit its context counted no
turn's tools. Now the scheduler keeps a digest of the tools of each session's last finished turn
(``GlobalScheduler.session_tools``: those its node's history holds) and counts a turn's tools
unless they are those; the gateway counts them in the turn's own tokens.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from cache_node.sampling_params import SamplingParams
from services.chat import ChatTemplater
from services.gateway_inputs import GenerateInput
from services.global_scheduler import GlobalScheduler
from services.node_request import NodeRequest
from tenants.model import TenantSpec
from tests import test_session_tools_admission
from tests.test_admission_sessions import scheduler
from tests.test_session_tools_admission import USER, _Preparation
from tests.test_tool_calls_served import TOOLS

WEATHER_TOOLS = '[{"type":"function","function":{"name":"get_weather"}}]'
FLIGHT_TOOLS = '[{"type":"function","function":{"name":"book_flight"}}]'

FINISHED = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 20, "completion_tokens": 1,
            "cached_tokens": {}, "ttft_ms": 50.0, "tpot_ms": 0.0, "preempted": False,
            "prefill_tokens_per_s": 300.0, "step_s": 0.2}
"""A node's ``finished`` event as the gateway forwards it to ``release`` (the harness's speeds)."""

templater = test_session_tools_admission.templater  # its fixture: SmolLM2's tokenizer, a template with tools


def turn(tenant: str, request_id: str, session: str, estimate: str, tools_tokens: str | None,
         tools: str) -> NodeRequest:
    extra = {"prompt_tokens_estimate": estimate} | ({} if tools_tokens is None else {"prompt_tokens_tools": tools_tokens})
    return NodeRequest(request_id=request_id, tenant=tenant, cache_namespace="ns", sampling=SamplingParams(),
                       messages=(USER,), session_id=session, extra=extra, tools=tools)


def admit(gs: GlobalScheduler, req: NodeRequest) -> Any:
    return gs.admit_and_submit(req, "gw", [])


def test_a_later_turns_other_tools_count_and_the_historys_do_not(tmp_path) -> None:
    """Behind a 500-token read (~1.77 s of the 2-s TTFT), a later turn of 20 tokens of messages
    and 300 of tools: the tools its session's last finished turn had are in its history (20
    tokens, ~1.83 s: admitted); other tools are rendered into the conversation anew (320 tokens,
    ~2.83 s: refused). Failed on the old code: the turn with other tools was admitted."""
    gs, ids = scheduler(tmp_path, "kvstrata")  # 300 prompt tokens/s, 2 s TTFT for "chat"
    chat = ids["chat"]
    assert admit(gs, turn(chat, "s1/1", "s1", "20", "300", WEATHER_TOOLS)).code == "OK"
    gs.release("s1/1", FINISHED)  # its node's history holds the weather tools now
    assert admit(gs, turn(chat, "s2/1", "s2", "500", None, "")).code == "OK"  # the backlog
    same = admit(gs, turn(chat, "s1/2", "s1", "20", "300", WEATHER_TOOLS))
    assert same.code == "OK", same
    gs.release("s1/2", FINISHED)
    other = admit(gs, turn(chat, "s1/3", "s1", "20", "300", FLIGHT_TOOLS))
    assert other.code == "RESOURCE_EXHAUSTED" and other.reason == "ttft_estimate", other
    added = admit(gs, turn(chat, "s1/4", "s1", "20", "300", f"{WEATHER_TOOLS[:-1]},{FLIGHT_TOOLS[1:]}"))
    assert added.code == "RESOURCE_EXHAUSTED" and added.reason == "ttft_estimate", added  # tools added
    sent = [m["req"]["request_id"] for _, m in gs.commands.sent]
    assert sent == ["s1/1", "s2/1", "s1/2"]
    assert not gs.turn_tools.keys() - {"s2/1"}  # (each released turn's entry goes)


def test_the_tools_of_a_turn_that_did_not_finish_are_not_the_sessions(tmp_path) -> None:
    """A turn whose tools differ from the history's and that did not finish (cancelled, refused
    on its node) leaves the history with the last finished turn's tools: the next turn with its
    tools counts them again (else cancelling a cheap turn would make the next one's tools free).
    A closed session's tools are forgotten with its route."""
    gs, ids = scheduler(tmp_path, "kvstrata")
    chat = ids["chat"]
    assert admit(gs, turn(chat, "s1/1", "s1", "20", "300", WEATHER_TOOLS)).code == "OK"
    gs.release("s1/1", FINISHED)
    assert admit(gs, turn(chat, "s1/2", "s1", "20", "300", FLIGHT_TOOLS)).code == "OK"  # (no backlog)
    gs.release("s1/2", None)  # cancelled: nothing ran
    assert admit(gs, turn(chat, "s2/1", "s2", "500", None, "")).code == "OK"
    again = admit(gs, turn(chat, "s1/3", "s1", "20", "300", FLIGHT_TOOLS))
    assert again.code == "RESOURCE_EXHAUSTED" and again.reason == "ttft_estimate", again
    assert set(gs.session_tools) == {"s1"}
    gs.drop_session_route("s1")
    assert gs.session_tools == {}


class _Refused(Exception):
    pass


class _Context:
    """A gRPC servicer context's ``abort`` (the one part ``_prepare`` calls when it refuses)."""

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Refused(code, details)


def test_the_gateway_counts_a_later_turns_tools_in_its_size(templater: ChatTemplater) -> None:
    """A session turn (the gateway cannot tell a first from a later one) whose few message
    tokens, its tools' hundreds and max_tokens pass the tenant's context is refused at the
    gateway, naming its tools, before its node renders it. Failed on the old code: only its
    messages were counted, and the turn went on to its node."""
    tools = TOOLS * 5
    preparation = _Preparation(templater)
    tools_tokens = len(templater.first_turn([USER], tools)) - len(templater.first_turn([USER]))
    assert tools_tokens > 400
    limit = 300
    tenant = SimpleNamespace(spec=TenantSpec("t", max_context_tokens=limit), tenant_id="t", kv_namespace="t")

    def prepare(with_tools: bool) -> Any:
        call = GenerateInput(prompt=[USER], sampling=SamplingParams(max_tokens=100), session_id="s",
                             tools=tools if with_tools else None)
        return asyncio.run(preparation._prepare(call, tenant, _Context()))

    try:
        plain, _ = prepare(False)  # its messages and max_tokens fit
        with pytest.raises(_Refused) as refused:
            prepare(True)
    finally:
        preparation._tokenizer_pool.shutdown()
    assert plain.extra["prompt_tokens_estimate"]
    code, details = refused.value.args
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert f"with their tools ({tools_tokens} tokens)" in details and f"maximum context length is {limit}" in details

