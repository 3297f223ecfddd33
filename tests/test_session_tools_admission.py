"""Admission counts the tokens a session's first turn renders for its tools.

A session turn's messages are rendered on its cache node, so admission sees their size only
through the gateway's estimate (``extra["prompt_tokens_estimate"]``). Regression: that estimate
rendered the messages without the turn's tools, which a chat template writes into the prompt
(a system message listing them, up to ``MAX_TOOLS_CHARS`` of JSON): a first turn with 5,000
tokens of tools was estimated at its 20 tokens of messages and admitted against a TTFT its node
could not meet. A later turn's history holds the tools already: they are not counted again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from cache_node.model_loader import resolve_model_dir
from cache_node.sampling_params import SamplingParams
from services.chat import ChatTemplater
from services.gateway_inputs import GenerateInput
from services.gateway_prepare import RequestPreparation
from services.global_scheduler_routing import MAX_PROMPT_ESTIMATE, prompt_size
from services.node_request import NodeRequest
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.test_admission_sessions import scheduler
from tests.test_tool_calls_served import TOOL_TEMPLATE, TOOLS

USER = {"role": "user", "content": "What is the weather in Paris?"}


@pytest.fixture(scope="module")
def templater() -> ChatTemplater:
    tokenizer = copy.deepcopy(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    tokenizer.chat_template = TOOL_TEMPLATE  # (SmolLM2's own template leaves tools out)
    return ChatTemplater(tokenizer)


class _Preparation(RequestPreparation):
    """The gateway's request preparation alone (``InferenceServicer``'s attributes it reads)."""

    def __init__(self, templater: ChatTemplater) -> None:
        self.info = {**NODE_INFO, "vocab_size": len(templater.tokenizer)}
        self.templater = templater
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1)


def turn(tenant: str, request_id: str, session: str, estimate: str, tools: str | None) -> NodeRequest:
    extra = {"prompt_tokens_estimate": estimate} | ({} if tools is None else {"prompt_tokens_tools": tools})
    return NodeRequest(request_id=request_id, tenant=tenant, cache_namespace="ns", sampling=SamplingParams(),
                       messages=(USER,), session_id=session, extra=extra, tools="[]")


def test_the_gateway_estimates_the_tools_a_first_turn_renders(templater: ChatTemplater) -> None:
    """The gateway sends what the template renders of the turn's tools beside the messages'
    estimate (failed on the old code: no ``prompt_tokens_tools``, so a first turn's estimate
    was its messages' alone)."""
    tenant = SimpleNamespace(spec=TenantSpec("t"), tenant_id="t", kv_namespace="t")
    preparation = _Preparation(templater)
    tools = TOOLS * 5  # ~976 tokens (20 times, ~3,900, can never fit the 2,048-token context: refused now)

    def prepare(with_tools: bool) -> NodeRequest:
        call = GenerateInput(prompt=[USER], sampling=SamplingParams(max_tokens=2), session_id="s",
                             tools=tools if with_tools else None)
        return asyncio.run(preparation._prepare(call, tenant, None))[0]

    try:
        plain, with_tools = prepare(False), prepare(True)
    finally:
        preparation._tokenizer_pool.shutdown()
    first = len(templater.first_turn([USER], tools))
    assert "prompt_tokens_tools" not in plain.extra
    assert with_tools.extra["prompt_tokens_estimate"] == plain.extra["prompt_tokens_estimate"]
    assert prompt_size(with_tools, new_tools=True) == first > len(templater.first_turn([USER])) + 400
    assert prompt_size(with_tools) == prompt_size(plain) == len(templater.first_turn([USER]))


def test_admission_counts_a_first_turns_tools(tmp_path) -> None:
    """Failed on the old code: behind a 500-token read, a first turn of 20 tokens of messages
    and 300 of tools was estimated at 20 (~1.83 s against 2 s) and admitted, where its 320
    tokens start after ~2.83 s. A later turn of a session is estimated without them (its history
    holds them: tests/test_session_tools_later_admission.py, its last finished turn's)."""
    gs, ids = scheduler(tmp_path, "kvstrata")  # 300 prompt tokens/s, 2 s TTFT for "chat"
    assert gs.admit_and_submit(turn(ids["chat"], "r1", "s1", "500", None), "gw", []).code == "OK"  # ~1.77 s
    refused = gs.admit_and_submit(turn(ids["chat"], "r2", "s2", "20", "300"), "gw", [])
    assert refused.code == "RESOURCE_EXHAUSTED" and refused.reason == "ttft_estimate"
    assert "s2" not in gs.session_nodes and [m["req"]["request_id"] for _, m in gs.commands.sent] == ["r1"]
    gs.release("r1", {"finish_reason": "stop", "prompt_tokens": 500, "completion_tokens": 1, "ttft_ms": 50.0,
                      "prefill_tokens_per_s": 300.0, "step_s": 0.2})  # s1's history holds its turn's tools ("[]") now
    assert gs.admit_and_submit(turn(ids["chat"], "r4", "s4", "500", None), "gw", []).code == "OK"  # ~1.77 s
    later = gs.admit_and_submit(turn(ids["chat"], "r3", "s1", "20", "300"), "gw", [])
    assert later.code == "OK"  # 20 tokens: the tools are in the session's history (~1.83 s)


def test_a_malformed_or_huge_tools_estimate_is_bounded() -> None:
    """The gateway's text is checked as the messages' estimate is: malformed or negative counts
    0, and the sum is capped at ``MAX_PROMPT_ESTIMATE``."""
    for bad in ("abc", "", "1.5", "-40"):
        assert prompt_size(turn("t", "r", "s", "100", bad), new_tools=True) == 100
    huge = str(10 * MAX_PROMPT_ESTIMATE)
    assert prompt_size(turn("t", "r", "s", huge, huge), new_tools=True) == MAX_PROMPT_ESTIMATE
    assert prompt_size(turn("t", "r", "s", "100", "-5")) == 100
