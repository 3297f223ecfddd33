"""What one Generate call carries into the gateway, whichever API it came through, and the ids
it is known by: ``GenerateInput`` (and ``input_from_pb`` for a gRPC ``GenerateRequest``),
``MAX_ID_CHARS``, ``scoped_id`` (a client's request or session id scoped to its tenant) and
``salted_namespace`` (a request's cache namespace under its ``cache_salt``).

Part of the gateway's inference servicer (``services.gateway``, which re-exports these names).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services import convert

MAX_ID_CHARS = 256
"""Longest client-chosen request or session id."""


def scoped_id(tenant_id: str, client_id: str) -> str:
    """The id the scheduler and the nodes know a client's request or session by: scoped to its
    tenant (``tenant_id`` is hex, so the first ``/`` separates the two), so that tenants never
    reach each other's requests or sessions by reusing an id."""
    return f"{tenant_id}/{client_id}"


@dataclass(frozen=True)
class GenerateInput:
    """One generation request, whichever API it came through (values already parsed by that
    API's edge; the gateway bounds them against the tenant and the model).

    Attributes:
        prompt: chat messages ``[{"role", "content"}]`` (with ``name`` and ``tool_call_id``
            where given: ``convert.chat_message``) or prompt token ids.
        policy: the KV policy override ("" = the tenant's policy).
        cache_salt: partitions the tenant's prefix cache further ("" = none): requests share
            cached blocks only with requests of the same tenant namespace and salt.
        routing_key: a routing hint (OpenAI's ``prompt_cache_key``): requests with the same key
            go to the same cache node while it has room ("" = none).
        fill_context: no max_tokens was given: generate up to what the context limit and the
            node's KV pool leave after the whole prompt (``sampling.max_tokens`` is ignored).
        priority: lower is served earlier among this tenant's own waiting requests on its
            node, never ahead of another tenant's; in [-1000, 1000] (else INVALID_ARGUMENT).
        prefix_tokens / prefix_messages: the prompt's reusable document prefix, as tokens of a
            token prompt or leading messages of a chat (``node_request.resolve_prefix_tokens``;
            out of bounds: INVALID_ARGUMENT).
        call_id: "" for a call of its own, whose ``request_id`` the gateway holds in flight
            while it runs; else the client's id of the call this request is one part of (a
            choice of an HTTP body with ``n`` > 1), which that call holds in flight
            (``InferenceServicer.hold_call``): this request holds nothing of its own. Set by
            the edge's code, never from a client's field.
        tools: the tools a chat's template renders (``apply_chat_template(tools=...)``;
            OpenAI's shape, checked by the HTTP edge: ``services.openai_api.tools``); None: none.
            A session turn's go to its node, which renders the turn with them.
        tool_output: how the HTTP edge reads a session turn's reply as tool calls
            (``services.chat_tools.tool_output_spec``; "" none): its node keeps such a reply as
            those calls. Set by the edge's code.
    """

    prompt: list[dict[str, str]] | list[int]
    sampling: SamplingParams
    session_id: str = ""
    request_id: str = ""
    policy: str = ""
    cache_salt: str = ""
    routing_key: str = ""
    fill_context: bool = False
    priority: int = 0
    prefix_tokens: int = 0
    prefix_messages: int = 0
    call_id: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_output: str = ""


def input_from_pb(request: inference_pb2.GenerateRequest) -> GenerateInput:
    """A ``GenerateRequest`` as a ``GenerateInput``. Raises ValueError naming the bad field."""
    return GenerateInput(
        prompt=convert.prompt_from_pb(request), sampling=convert.sampling_params_from_pb(request.sampling),
        session_id=request.session_id, request_id=request.request_id, policy=convert.policy_from_pb(request.policy, ""),
        priority=request.priority, prefix_tokens=request.prefix_tokens,
        prefix_messages=request.prefix_messages,
    )


def salted_namespace(namespace: str, cache_salt: str) -> str:
    """The cache namespace of a request with ``cache_salt`` (its tenant's namespace otherwise):
    a salt cannot name another tenant's namespace, whose names hold no ``#``."""
    return f"{namespace}#salt={cache_salt}" if cache_salt else namespace
