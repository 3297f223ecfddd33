"""A KV policy spec is bounded before it is parsed: 63 characters (the tenant policy pattern)
at the network's entry points (the HTTP schema, the data plane's request decoding; gRPC had
it), 256 in the registry (engine callers such as benches name longer ones).

Regression (security review 19 H2): the HTTP ``policy`` field had no length bound (gRPC's
``policy_from_pb`` has one), parsing cost ~2 µs a character, and the spec was parsed on the
gateway's event loop and again on the cache node's step thread: a 1 MB valid spec
(``snapkv-0.5-0.5-...``) stalled every tenant's gateway calls 5.2 s and the node's step
thread 6.2 s.
"""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from cache_node.policies import make_policy
from cache_node.policies.registry import SPEC_PATTERN, parse_spec
from cache_node.sampling_params import SamplingParams
from services.data_plane import request_from_wire, request_to_wire
from services.node_request import NodeRequest
from services.openai_api.schemas import ChatCompletionRequest
from tenants.model import POLICY_PATTERN

LONG = "snapkv" + "-0.5" * 250_000  # a valid spec of 1,000,006 characters


def test_the_registry_takes_the_tenant_patterns_characters() -> None:
    assert SPEC_PATTERN.pattern.replace("255", "62") == POLICY_PATTERN.pattern


def test_a_long_spec_is_refused_before_parsing_and_echoed_briefly() -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"at most 256 characters.*\(1000006 characters\)") as info:
        make_policy(LONG)
    assert time.perf_counter() - start < 0.5  # was seconds: every part parsed
    assert len(str(info.value)) < 300
    with pytest.raises(ValueError, match="at most 256"):
        parse_spec("snapkv" + "-0.5" * 63)  # 258 characters, valid otherwise
    assert parse_spec("snapkv" + "-0.5" * 62)[1] == {"budget": 0.5}  # 254 characters


@pytest.mark.parametrize("spec", ["", "-snapkv", "snapkv 0.5", "snapkv/0.5", "snäpkv"])
def test_specs_off_the_pattern_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="must match"):
        make_policy(spec)


def test_the_http_schema_refuses_a_long_policy() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(body | {"policy": "snapkv-0.5"}).policy == "snapkv-0.5"
    with pytest.raises(ValidationError, match="at most 63 characters"):
        ChatCompletionRequest.model_validate(body | {"policy": LONG})


def _wire(**fields) -> dict:
    req = NodeRequest(request_id="r", tenant="t", cache_namespace="tenant:t", token_ids=(1, 2, 3),
                      sampling=SamplingParams(max_tokens=2), **fields)
    return request_to_wire(req)


def test_the_data_plane_refuses_a_long_policy_or_session_id() -> None:
    assert request_from_wire(_wire(policy="snapkv-0.5")).policy == "snapkv-0.5"
    for fields in ({"policy": LONG}, {"policy": "snap kv"}, {"session_id": "s" * 1025}):
        with pytest.raises(ValueError, match="request.(policy|session_id)"):
            request_from_wire(_wire(**fields))
