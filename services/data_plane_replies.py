"""What the gateway reads off the data plane: its nodes' event messages and the scheduler's
admission replies, each value checked.

A node's event message is ``[[request_id, event], ...]`` (``checked_event_items``; each event
checked by ``check_event``, a bad one failing its own request alone); a scheduler's reply is
``{"id", "adm"}`` or ``{"id", "error"}`` (``admission_reply``; ``BadReply`` when its envelope is
sound and its admission is not). Limits and field checks are ``services.data_plane_wire``'s.

A part of ``services.data_plane``, which re-exports its public names.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Collection
from typing import Any

from cache_node.sampling_params import MAX_LOGPROBS
from services.block_index import TIERS
from services.data_plane_wire import (
    FINISH_REASONS,
    MAX_COUNT,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_RETRY_AFTER_S,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    _check_fields,
    _check_len,
    _check_range,
    _check_type,
    _cut,
)
from services.node_request import check_priority

_NUMBER = (int, float)
_EVENT_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {  # all required
    "started": {"request_id": str, "node_id": str, "prompt_tokens": int},
    "delta": {"token_ids": list, "text": str},
    "finished": {"finish_reason": (str, type(None)), "prompt_tokens": int, "completion_tokens": int},
    "error": {"code": str, "message": str},
}
_EVENT_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "cached_tokens": dict, "queue_ms": _NUMBER, "ttft_ms": _NUMBER, "tpot_ms": _NUMBER,
    "preempted": bool, "prefill_tokens_per_s": _NUMBER, "step_s": _NUMBER, "priority": int,
    "policy_stats": dict, "logprobs": list, "retry_after_s": _NUMBER, "prompt_logprobs": list,
    "grammar_wait_ms": _NUMBER,
}

_ADMISSION_FIELDS: dict[str, type | tuple[type, ...]] = {
    "node_id": str, "code": str, "message": str, "retry_after_s": (int, float), "spill_blocks": int,
    "reason": str, "continues_session": bool,
}


class BadReply(ValueError):
    """An admission reply whose envelope (its correlation id ``corr``) is sound and whose
    values are not: the admission it answers fails (``NodeStreams``)."""

    def __init__(self, corr: Any, message: str) -> None:
        super().__init__(message)
        self.corr = corr


_EVENT_COUNTS = ("prompt_tokens", "completion_tokens")
_EVENT_TIMES = ("queue_ms", "ttft_ms", "tpot_ms", "prefill_tokens_per_s", "step_s", "grammar_wait_ms")


def check_event(event: Any) -> dict[str, Any]:
    """``event`` (a node event as in ``services.node_request``) checked: its type's fields
    with their types, and their values: counts, token ids and ``cached_tokens`` in
    [0, ``MAX_COUNT``], times finite and >= 0, ``priority`` in range, ids bounded, tier names
    in ``TIERS`` and a ``finish_reason`` in ``FINISH_REASONS`` (both become metric labels or
    API values), an error's ``code`` a gRPC status name other than OK and its optional
    ``retry_after_s`` in [0, ``MAX_RETRY_AFTER_S``] (finite, no NaN). Returns it (an error's
    ``message`` cut to ``MAX_TEXT_CHARS``).

    Raises:
        TypeError, ValueError: naming the bad field.

    Regression (security review D): only types were checked: a negative count or token id
    failed later, in the stream's protobuf (uint32) or metrics counter, and one bad event
    dropped its whole message, leaving every stream in it waiting for events that never came.
    Regression: any ``finish_reason`` of up to 64 characters passed, a new metric series per
    value (``kvstrata:request_success_total{finished_reason}``) and the OpenAI API's value; an
    unknown tier in ``cached_tokens`` passed here and failed the scheduler's usage record.
    """
    _check_type("event", event, dict)
    schema = _EVENT_FIELDS.get(event.get("type"))
    if schema is None:
        raise ValueError(f"unknown event type {event.get('type')!r}")
    for name, kind in schema.items():
        _check_type(f"event.{name}", event.get(name), kind)
    for name, kind in _EVENT_OPTIONAL.items():
        if name in event:
            _check_type(f"event.{name}", event[name], kind)
    tokens = event.get("token_ids", ())
    if not all(type(t) is int for t in tokens):
        raise TypeError("event.token_ids must be integers")
    if tokens and not 0 <= min(tokens) <= max(tokens) <= MAX_TOKEN_ID:
        raise ValueError(f"event.token_ids must lie in [0, {MAX_TOKEN_ID}]")
    if "logprobs" in event:
        _check_logprobs(event)
    if "prompt_logprobs" in event:
        _check_prompt_logprobs(event)
    cached = event.get("cached_tokens", {})
    if not all(isinstance(k, str) and type(v) is int for k, v in cached.items()):
        raise TypeError("event.cached_tokens must map tier names to integers")
    if not all(k in TIERS and 0 <= v <= MAX_COUNT for k, v in cached.items()):
        raise ValueError(f"event.cached_tokens must map tier names of {TIERS} to counts in [0, {MAX_COUNT}]")
    for name in _EVENT_COUNTS:
        if name in event:
            _check_range(f"event.{name}", event[name], 0, MAX_COUNT)
    for name in _EVENT_TIMES:
        if name in event:
            _check_range(f"event.{name}", event[name], 0, math.inf)
            if math.isinf(event[name]):
                raise ValueError(f"event.{name} must be finite")
    if "priority" in event:
        check_priority(event["priority"])
    if "retry_after_s" in event:  # an error's retry hint (the gateway's ``retry-after-ms``)
        if event["type"] != "error":
            raise ValueError("event.retry_after_s belongs to an error event only")
        _check_range("event.retry_after_s", event["retry_after_s"], 0, MAX_RETRY_AFTER_S)
    for name in ("request_id", "node_id"):
        if name in event:
            _check_len(f"event.{name}", event[name], MAX_ID_CHARS)
    if event.get("finish_reason") is not None and event["finish_reason"] not in FINISH_REASONS:
        raise ValueError(f"event.finish_reason must be one of {FINISH_REASONS}, got "
                         f"{event['finish_reason'][:MAX_NAME_CHARS]!r}")
    if event["type"] == "error":
        if event["code"] not in status_names() or event["code"] == "OK":
            raise ValueError(f"event.code must be a gRPC status name other than OK, got {event['code']!r}")
        if len(event["message"]) > MAX_TEXT_CHARS:
            event = {**event, "message": _cut(event["message"])}
    return event


def _check_logprobs(event: dict[str, Any]) -> None:
    """A delta's ``logprobs``: one ``services.node_request.logprobs_entry`` per token id, each
    ``[logprob, id_1, logprob_1, ...]`` with at most ``MAX_LOGPROBS`` distinct ids in
    [0, ``MAX_TOKEN_ID``] and log probabilities that are floats in [-inf, 0] (no NaN), the top
    ones most probable first. Raises TypeError, ValueError naming ``event.logprobs``."""
    entries = event["logprobs"]
    if event["type"] != "delta" or len(entries) != len(event["token_ids"]):
        raise ValueError("event.logprobs must be a delta's, one entry per token id")
    for entry in entries:
        if not isinstance(entry, list) or not len(entry) % 2 or len(entry) > 1 + 2 * MAX_LOGPROBS:
            raise TypeError(f"event.logprobs entries must be [logprob, id, logprob, ...] of at most "
                            f"{MAX_LOGPROBS} ids")
        ids, values = entry[1::2], entry[0::2]
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"event.logprobs ids must be distinct integers in [0, {MAX_TOKEN_ID}]")
        if not all(type(v) is float and v <= 0.0 for v in values):  # NaN fails too
            raise ValueError("event.logprobs values must be floats in [-inf, 0]")
        if any(a < b for a, b in itertools.pairwise(values[1:])):  # the top ones
            raise ValueError("event.logprobs top entries must come most probable first")


def _check_prompt_logprobs(event: dict[str, Any]) -> None:
    """A delta's ``prompt_logprobs``: ``services.node_request.prompt_logprobs_entry`` each,
    ``[token_id, logprob, rank, id_1, logprob_1, ...]``: the token and the ids integers in
    [0, ``MAX_TOKEN_ID``] (the top ones distinct), the values floats in [-inf, 0] with the top
    ones most probable first, the rank an integer in [1, ``MAX_TOKEN_ID`` + 1]. Raises
    TypeError, ValueError naming ``event.prompt_logprobs``."""
    if event["type"] != "delta":
        raise ValueError("event.prompt_logprobs must be a delta's")
    for entry in event["prompt_logprobs"]:
        if not isinstance(entry, list) or len(entry) < 3 or not len(entry) % 2 or len(entry) > 3 + 2 * MAX_LOGPROBS:
            raise TypeError(f"event.prompt_logprobs entries must be [token_id, logprob, rank, id, logprob, ...] of "
                            f"at most {MAX_LOGPROBS} ids")
        ids, values = entry[3::2], [entry[1], *entry[4::2]]
        if not all(type(t) is int and 0 <= t <= MAX_TOKEN_ID for t in (entry[0], *ids)) or len(set(ids)) != len(ids):
            raise ValueError(f"event.prompt_logprobs token ids must be integers in [0, {MAX_TOKEN_ID}], the top "
                             "ones distinct")
        if type(entry[2]) is not int or not 1 <= entry[2] <= MAX_TOKEN_ID + 1:
            raise ValueError(f"event.prompt_logprobs ranks must be integers in [1, {MAX_TOKEN_ID + 1}]")
        if not all(type(v) is float and v <= 0.0 for v in values):  # NaN fails too
            raise ValueError("event.prompt_logprobs values must be floats in [-inf, 0]")
        if any(a < b for a, b in itertools.pairwise(values[1:])):
            raise ValueError("event.prompt_logprobs top entries must come most probable first")


def check_logprobs_asked(event: dict[str, Any], logprobs: int | None, prompt_logprobs: int | None = None) -> None:
    """``event`` (checked: ``check_event``) gives what its request asked: a delta's token ids
    each with ``logprobs`` top entries when it is set, and no logprobs when it is None; its
    prompt entries each with ``prompt_logprobs`` top entries, none when that is None.

    Raises:
        ValueError: naming ``event.logprobs`` or ``event.prompt_logprobs``.
    """
    if event["type"] != "delta":
        return
    prompt = event.get("prompt_logprobs") or ()
    if prompt and (prompt_logprobs is None or any(len(e) != 3 + 2 * prompt_logprobs for e in prompt)):
        raise ValueError("event.prompt_logprobs must hold " + ("none: its request asked for none" if prompt_logprobs
                         is None else f"{prompt_logprobs} top entries for each prompt token, as its request asked"))
    entries = event.get("logprobs") or ()
    if logprobs is None:
        if entries:
            raise ValueError("event.logprobs for a request that asked for none")
    elif len(entries) != len(event["token_ids"]) or any(len(e) != 1 + 2 * logprobs for e in entries):
        raise ValueError(f"event.logprobs must hold {logprobs} top entries for each token id, as its request asked")


def checked_event_items(data: Any) -> list[tuple[str, dict[str, Any] | TypeError | ValueError]]:
    """The non-empty ``[[request_id, event], ...]`` of a node's event message, in order, each
    event checked (``check_event``) and replaced by the error that refused it when bad: a bad
    event fails its own request alone.

    Raises:
        TypeError, ValueError: ``data`` is not such a list (the whole message is bad).
    """
    _check_type("events", data, list)
    if not data:
        raise ValueError("an event message holds at least one event")
    items: list[tuple[str, dict[str, Any] | TypeError | ValueError]] = []
    for item in data:
        if not isinstance(item, list) or len(item) != 2:
            raise TypeError("an event item must be [request_id, event]")
        request_id, event = item
        _check_type("request_id", request_id, str)
        try:
            items.append((request_id, check_event(event)))
        except (TypeError, ValueError) as exc:
            items.append((request_id, exc))
    return items


def event_item_pairs(data: Any) -> list[tuple[str, Any]]:
    """The non-empty ``[[request_id, event], ...]`` of a node's event message, in order, with
    only its shape checked (each item a pair, each request id a str): the events themselves
    are not (``check_event``, or ``looks_like_event`` for one no stream waits for). A reader
    looks each id up first and checks only the events of streams open there, so events for
    ids it does not have cost no checks (review s34 B F6: ~40 us each, 1.1 s of the
    gateway's loop for one node's two ~1.15 MB messages of unknown ids).

    Raises:
        TypeError, ValueError: ``data`` is not such a list (the whole message is bad).
    """
    _check_type("events", data, list)
    if not data:
        raise ValueError("an event message holds at least one event")
    for item in data:
        if not isinstance(item, list) or len(item) != 2:
            raise TypeError("an event item must be [request_id, event]")
        if type(item[0]) is not str:
            _check_type("request_id", item[0], str)
    return [(item[0], item[1]) for item in data]


def looks_like_event(event: Any) -> bool:
    """Whether ``event`` is a dict of a known event ``type`` (O(1): none of its fields are
    checked): what a reader asks of an event it drops unchecked, for a request it does not
    have (``event_item_pairs``); anything else counts as a malformed message, as before."""
    return type(event) is dict and type(event.get("type")) is str and event["type"] in _EVENT_FIELDS


def event_items(data: Any) -> list[tuple[str, dict[str, Any]]]:
    """``checked_event_items`` of a message whose every event is good.

    Raises:
        TypeError, ValueError: ``data`` is not such a list, or an event in it is bad.
    """
    items = []
    for request_id, event in checked_event_items(data):
        if isinstance(event, Exception):
            raise event
        items.append((request_id, event))
    return items


def admission_reply(data: Any, nodes: Collection[str] | None = None) -> tuple[Any, dict[str, Any] | str]:
    """The correlation id and the admission fields (or the error text, cut to
    ``MAX_TEXT_CHARS``) of a scheduler reply, values checked: ``code`` a gRPC status name,
    ``node_id`` one of ``nodes`` when admitted (None: any), ``retry_after_s`` finite in
    [0, ``MAX_RETRY_AFTER_S``], ``spill_blocks`` in [0, ``MAX_COUNT``], ``reason`` "" or one
    of ``global_scheduler_checks.REJECT_REASONS`` (a metric label), ``node_id`` bounded (``message``
    cut to ``MAX_TEXT_CHARS``).

    Raises:
        BadReply: a sound envelope with bad admission fields (the admission ``corr`` fails);
        TypeError, ValueError: a malformed envelope.

    Regression (security review D): only types were checked, and the gateway trusted the
    values: ``retry_after_s`` inf or NaN raised there (an internal error instead of the
    RESOURCE_EXHAUSTED), a negative one went out as a negative ``retry-after-ms``, and an OK
    naming a node the gateway does not know left its stream waiting forever (its cancel then
    raised KeyError).
    """
    _check_fields("reply", data, {"id": (int, type(None)), "adm": dict, "error": str}, ("id",))
    if "error" in data:
        return data["id"], _cut(data["error"])
    if "adm" not in data:
        raise TypeError("reply: neither adm nor error")
    try:
        adm = _admission_fields(data["adm"], nodes)
    except (TypeError, ValueError) as exc:
        raise BadReply(data["id"], f"{type(exc).__name__}: {exc}") from exc
    return data["id"], adm


def _admission_fields(adm: Any, nodes: Collection[str] | None) -> dict[str, Any]:
    _check_fields("reply.adm", adm, _ADMISSION_FIELDS, tuple(_ADMISSION_FIELDS))
    if adm["code"] not in status_names():
        raise ValueError(f"unknown status {adm['code']!r}")
    if adm["code"] == "OK" and nodes is not None and adm["node_id"] not in nodes:
        raise ValueError(f"reply.adm.node_id {adm['node_id'][:MAX_NAME_CHARS]!r} is no node of this gateway")
    _check_len("reply.adm.node_id", adm["node_id"], MAX_ID_CHARS)
    _check_range("reply.adm.retry_after_s", adm["retry_after_s"], 0, MAX_RETRY_AFTER_S)
    _check_range("reply.adm.spill_blocks", adm["spill_blocks"], 0, MAX_COUNT)
    if adm["reason"] and adm["reason"] not in _reject_reasons():
        raise ValueError(f"reply.adm.reason {adm['reason'][:MAX_NAME_CHARS]!r} is none of REJECT_REASONS")
    return {**adm, "message": _cut(adm["message"])}


@functools.cache
def _reject_reasons() -> frozenset[str]:
    from services.global_scheduler_checks import REJECT_REASONS  # loaded when first needed

    return frozenset(REJECT_REASONS)


@functools.cache
def status_names() -> frozenset[str]:
    """gRPC status code names (what error events and admissions carry)."""
    import grpc

    return frozenset(c.name for c in grpc.StatusCode)
