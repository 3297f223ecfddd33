"""A structured-output request refused for the node's reasons (its load starved the compile,
the node is shutting down, the compiler failed) gets a retryable status, not INVALID_ARGUMENT:
RESOURCE_EXHAUSTED with a 1 s retry hint when the node is too busy (HTTP 429 + Retry-After),
UNAVAILABLE otherwise. A spec's own failure stays INVALID_ARGUMENT. Regression (review 28b F2
follow-up): every compile refusal was INVALID_ARGUMENT (HTTP 400: "do not send this again"),
though the same spec compiles once the node is less busy. The starved compile itself, with a
real compiler process, is in ``test_grammar_compile_cpu_limit``."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from cache_node.grammar_compile import SHUTTING_DOWN, GrammarUnavailable
from cache_node.grammar_mask import GrammarState
from cache_node.outputs import RequestOutput
from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from services import data_plane
from services.cache_node import CacheNode
from services.cache_node_streams import _Stream
from services.config import NodeConfig
from services.node_request import NodeRequest

SPEC = StructuredOutputSpec("regex", "[ab]+")


class Compiled:
    """``Grammars`` as ``GrammarState`` sees it: ``compile`` hands back ``future``."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def compile(self, spec, tenant, namespace=""):  # type: ignore[no-untyped-def]
        return self.future


def _state(error: BaseException) -> GrammarState:
    future: Future = Future()
    future.set_exception(error)
    state = GrammarState(Compiled(future), SPEC, "t")  # type: ignore[arg-type]
    assert state.poll()
    return state


@pytest.mark.parametrize(("error", "code", "retry"), [
    (GrammarUnavailable("structured_output regex: ... this cache node is too busy to compile it now; retry later",
                        busy=True), "RESOURCE_EXHAUSTED", 1.0),
    (GrammarUnavailable(SHUTTING_DOWN), "UNAVAILABLE", 0.0),
    (ValueError("structured_output regex: its grammar does not compile"), "", 0.0),
])
def test_a_refusal_keeps_whose_fault_it_was(error: BaseException, code: str, retry: float) -> None:
    state = _state(error)
    assert (state.error, state.error_code, state.retry_after_s) == (str(error), code, retry)


@pytest.fixture(scope="module")
def node():
    n = CacheNode("codes", NodeConfig(kv_pool_bytes=32 << 20, host_bytes=0), num_threads=1)
    yield n
    n.shutdown()


@pytest.mark.parametrize(("code", "retry"), [("RESOURCE_EXHAUSTED", 1.0), ("UNAVAILABLE", 0.0), ("", 0.0)])
def test_the_nodes_error_event_carries_the_status_and_hint(node, code: str, retry: float) -> None:
    req = NodeRequest(request_id="r", tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                      sampling=SamplingParams(max_tokens=4, structured_output=SPEC))
    out = RequestOutput("r", (), True, "rejected", 3, 0, 0, 0, None, error="structured_output regex: no",
                        error_code=code, retry_after_s=retry)
    [event] = node._events(out, _Stream(None, None, req, 3))
    assert event["code"] == (code or "INVALID_ARGUMENT") and event.get("retry_after_s", 0.0) == retry
    assert data_plane.check_event(event) == event  # the gateway takes it as it is
