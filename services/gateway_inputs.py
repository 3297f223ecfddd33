"""What one Generate call carries into the gateway, whichever API it came through, and the ids
it is known by: ``GenerateInput`` (and ``input_from_pb`` for a gRPC ``GenerateRequest``),
``MAX_ID_CHARS``, ``scoped_id`` (a client's request id scoped to its tenant), ``session_scope``
(a client's session id scoped to its tenant and its ``cache_salt``), ``request_scope`` (a
request id held in flight, scoped as a session id) and
``salted_namespace`` (a request's cache namespace under its ``cache_salt``).

Part of the gateway's inference servicer (``services.gateway``, which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from cache_node.sampling_params import SamplingParams
from cache_node.session_ids import SALT_TAG_CHARS, SALTED_MARK
from kvstrata.v1 import inference_pb2
from services import convert, tool_requests
from services.chat import content_chars
from services.chat_tools import auto_constraint, tool_output_spec

MAX_ID_CHARS = 256
"""Longest client-chosen request or session id."""


def scoped_id(tenant_id: str, client_id: str) -> str:
    """The id the scheduler and the nodes know a client's request by: scoped to its tenant
    (``tenant_id`` is hex, so the first ``/`` separates the two), so that tenants never reach
    each other's requests by reusing an id. A session's id is ``session_scope``'s."""
    return f"{tenant_id}/{client_id}"


def session_scope(tenant_id: str, cache_salt: str, session_id: str) -> str:
    """The id the scheduler and the nodes know a client's session by: scoped to its tenant and
    to the ``cache_salt`` its turns are sent with. Without a salt it is ``scoped_id``'s
    ``<tenant>/<session_id>``, the id every session had before salts scoped them (so the routes,
    lost-session marks and node sessions of an earlier version's unsalted sessions keep
    their ids across an upgrade); with one it is ``<tenant>:<tag>/<session_id>``
    (``cache_node.session_ids.SALTED_MARK``), the tag the first ``SALT_TAG_CHARS`` (32) hex digits
    of the salt's SHA-256 (its UTF-8 bytes; a lone surrogate, which the edges refuse, hashed
    rather than raising).

    One id is one (tenant, salt, session id) alone, for any characters of the session id: a
    tenant id is hex (no ``/`` nor ``:``), so the text before an id's first ``/`` is the bare
    tenant id for an unsalted session and ``<tenant>:<tag>`` for a salted one (never equal,
    whatever follows), and the tag holds no ``/``, so the client's id is all after it
    (``cache_node.session_ids.client_session_id`` reads it back). Two salts meet by chance only
    (a 128-bit tag). Under another salt, or none, the same ``session_id`` names another session,
    as the salt gives the requests another cache namespace (``salted_namespace``), and the node
    refuses a turn whose namespace is not its session's (``cache_node.sessions.check_turn``).

    Regressions: (review s36 E1) the session id was scoped by the tenant alone, so a caller
    under another salt (or none) naming the same id continued, rewrote or closed the first
    salt's session, its pinned history answering the other caller's turns. (review s36 R2 F1)
    cfcfb59 named an unsalted session ``<tenant>//<session_id>``: after an upgrade the sessions
    stored and held under the old ``<tenant>/<session_id>`` were lost without a word (a lost
    session's next turn opened a new, empty one instead of ABORTED ``session_lost``; routes to
    nodes that kept running counted against the tenant's session limit until their TTL, and
    the client could not close them)."""
    if not cache_salt:
        return scoped_id(tenant_id, session_id)
    tag = hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).hexdigest()[:SALT_TAG_CHARS]
    return f"{tenant_id}{SALTED_MARK}{tag}/{session_id}"


def request_scope(tenant_id: str, cache_salt: str, client_id: str) -> str:
    """The key a gateway holds a client's request id in flight under (``InferenceServicer``'s
    ALREADY_EXISTS check): scoped to its tenant and to its ``cache_salt``, in
    ``session_scope``'s form, so a request id is one (tenant, salt, id) as a session id is.
    The id the scheduler and the nodes know the request by stays ``scoped_id``'s (each attempt
    with a random suffix of its own: ``InferenceServicer._generate``), reachable by no client.

    Regression (s37): the in-flight ids were scoped by the tenant alone, so a caller under
    another salt (or none) reusing an id in flight under a salt was refused ALREADY_EXISTS: an
    oracle telling it which ids the other namespace's callers had in flight, and when, and a
    way to keep them from using an id (hold it first, and theirs is refused)."""
    return session_scope(tenant_id, cache_salt, client_id)


@dataclass(frozen=True)
class GenerateInput:
    """One generation request, whichever API it came through (values already parsed by that
    API's edge; the gateway bounds them against the tenant and the model).

    Attributes:
        prompt: chat messages ``[{"role", "content"}]`` (with ``name`` and ``tool_call_id``
            where given: ``convert.chat_message``) or prompt token ids.
        policy: the KV policy override ("" = the tenant's policy).
        cache_salt: partitions the tenant's prefix cache further ("" = none): requests share
            cached blocks only with requests of the same tenant namespace and salt, and a
            ``session_id`` names a session of that salt alone (``session_scope``).
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
            OpenAI's shape, checked by the edge: ``services.tool_requests``, the HTTP edge's
            ``services.openai_api.tools``, gRPC's ``input_from_pb``); None: none. A session
            turn's go to its node, which renders the turn with them.
        tool_output: how the edge reads a session turn's reply as tool calls
            (``services.chat_tools.tool_output_spec``; "" none): its node keeps such a reply as
            those calls. Set by the edge's code (the gRPC API's for every request whose reply it
            reads as calls: ``InferenceServicer.Generate`` reads it back).
        constraint_field: the gRPC field that gave ``sampling.structured_output``
            (``tool_choice`` or ``sampling.structured_output``; "" none, and for the HTTP edge,
            which names its own: ``errors.refusal_about``): a node's refusal of the constraint
            is worded for it (``grpc_refusal``).
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
    constraint_field: str = ""


def input_from_pb(request: inference_pb2.GenerateRequest, tool_call_parser: str = "",
                  seed: str = "") -> GenerateInput:
    """A ``GenerateRequest`` as a ``GenerateInput``. Raises ValueError naming the bad field.

    ``tool_call_parser``: the server's (``tool_requests.auto_refusal``); ``seed``: the tool call
    ids of a reply read as calls come from it (``tool_calls.ToolOutput``; "": the reply is not
    read, ``tool_output`` left "")."""
    prompt = convert.prompt_from_pb(request)
    sampling = convert.sampling_params_from_pb(request.sampling)
    given = "sampling.structured_output" if sampling.structured_output is not None else ""
    tools, sampling, tool_output = _tools_from_pb(request, prompt, sampling, tool_call_parser, seed)
    constrained = "tool_choice" if sampling.structured_output is not None and not given else given
    return GenerateInput(
        prompt=prompt, sampling=sampling,
        session_id=request.session_id, request_id=request.request_id, policy=convert.policy_from_pb(request.policy, ""),
        cache_salt=request.cache_salt,
        priority=request.priority, prefix_tokens=request.prefix_tokens,
        prefix_messages=request.prefix_messages, tools=tools, tool_output=tool_output,
        constraint_field=constrained,
    )


_HTTP_MESSAGE_PATH = re.compile(r"^messages((?:\.\w+)*)(?=[: ])")


def grpc_refusal(message: str, call: GenerateInput | None) -> str:
    """A refusal's words (INVALID_ARGUMENT, from the gateway's checks past ``input_from_pb`` or
    from a cache node) in the gRPC API's field paths: a chat's ``messages`` / ``messages.N.field``
    (the HTTP API's paths, which the shared checks write: ``chat_tools.check_session_tool_answers``,
    ``ChatTemplater.check_fits``) as ``chat.messages`` / ``chat.messages[N].field``, and a
    constraint the node refuses ("structured_output json_schema does not compile: ...") as the
    field that gave it (``GenerateInput.constraint_field``). Regressions (review 30j F2, F7): a
    named tool choice whose schema does not compile was refused naming
    ``structured_output``, which the client never sent; a session turn's tool message answering
    no call named ``messages.0.tool_call_id``."""
    path = _HTTP_MESSAGE_PATH.match(message)
    if path is not None:
        return "chat.messages" + re.sub(r"\.(\d+)", r"[\1]", path.group(1)) + message[path.end():]
    if call is not None and call.constraint_field and message.startswith("structured_output"):
        if call.constraint_field == "tool_choice":
            return f"tool_choice: {message.removeprefix('structured_output ')}"
        return f"sampling.{message}"
    return message


def _tools_from_pb(request: inference_pb2.GenerateRequest, prompt: list[Any], sampling: SamplingParams,
                   tool_call_parser: str, seed: str) -> tuple[list[dict[str, Any]] | None, SamplingParams, str]:
    """A request's tool calling as the HTTP edge serves it (``services.openai_api.tools``, with
    the same checks, ``services.tool_requests``): the tools the template renders, the sampling
    constrained by a named or required choice, or by an auto one when
    ``sampling.structured_output`` is not given and every tool is strict
    (``Tool.strict``, OpenAI's ``function.strict``; ``chat_tools.auto_constraint``; otherwise a
    gRPC "auto" is read from free text, as vLLM's default), and ``tool_output``'s spec.

    Raises:
        ValueError: ``tools``, ``tool_choice`` or ``parallel_tool_calls`` with tokens input (a
            text completion takes none of them; ``tool_choice`` none aside), a bad tool or
            choice (``convert.tools_from_pb``, ``tool_choice_from_pb``,
            ``tool_requests.choice_mode``), the chat's characters with the tools past
            ``MAX_PROMPT_CHARS``, "auto" without the server's tool call parser, or a named or
            required choice with ``sampling.structured_output``.
    """
    choice, named = convert.tool_choice_from_pb(request)
    if request.WhichOneof("input") != "chat":
        for field, given in (("tools", bool(request.tools)), ("tool_choice", named is not None or choice
                             not in (None, "none")), ("parallel_tool_calls", request.HasField("parallel_tool_calls"))):
            if given:
                raise ValueError(f"{field} applies to chat input (GenerateRequest.chat), not to tokens: the chat "
                                 "template renders tools")
        return None, sampling, ""
    tools = convert.tools_from_pb(request.tools)
    # as the HTTP edge counts them: the messages as the template takes them (a call's arguments
    # as compact JSON, which may be longer than as sent: 1E15 is 1000000000000000.0), and the
    # tools' compact JSON. Regression (review 30j F4): without tools the arguments were counted
    # as sent only, so 1 MiB of them came to 3.8 MiB rendered
    chars = content_chars(prompt) + (len(json.dumps(tools, ensure_ascii=False, separators=(",", ":"))) if tools else 0)
    if chars > convert.MAX_PROMPT_CHARS:
        raise ValueError(f"chat.messages hold {chars} characters{' with the tools' if tools else ''} as the chat "
                         f"template takes them; at most {convert.MAX_PROMPT_CHARS} are allowed")
    mode = tool_requests.choice_mode(choice, named, tools)
    refusal = tool_requests.auto_refusal(mode, tool_call_parser)
    if refusal is not None:
        raise ValueError(refusal)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    constraint = tool_requests.tool_constraint(mode, tools or [], named, parallel)
    if mode == "auto" and tools and sampling.structured_output is None:  # as the HTTP edge's ToolFields
        try:
            constraint = auto_constraint(tools, parallel)
        except ValueError as exc:
            raise ValueError(f"tool_choice: the auto tool calls' constraint is refused: {exc}") from None
    if constraint is not None:
        tool_requests.check_one_constraint(mode, ["sampling.structured_output"] if sampling.structured_output else [])
        sampling = dataclasses.replace(sampling, structured_output=constraint)
    names = [tool["function"]["name"] for tool in tools or []]  # (an "auto" reply calling another is content)
    return tools, sampling, tool_output_spec(mode, named, parallel, seed, names) if mode != "none" and seed else ""


def salted_namespace(namespace: str, cache_salt: str) -> str:
    """The cache namespace of a request with ``cache_salt`` (its tenant's namespace otherwise):
    a salt cannot name another tenant's namespace, whose names hold no ``#``."""
    return f"{namespace}#salt={cache_salt}" if cache_salt else namespace
