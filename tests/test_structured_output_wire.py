"""``SamplingParams.structured_output`` on the node data plane (``services.data_plane_wire``):
it travels as ``[kind, spec]`` (None: off), and ``request_from_wire`` checks its shape and
types, then rebuilds the ``StructuredOutputSpec`` (whose ValueError names
``structured_output``), since every byte off the network is untrusted.

Regression: ``_SAMPLING_FIELDS`` lacked the field that 52be7a3 added to ``SamplingParams``, so
every request crossing the data plane was refused "request.sampling: unknown fields
['structured_output']" (and ``request_to_wire`` put a dataclass msgpack cannot pack in it).
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputSpec
from services import data_plane, data_plane_wire
from services.node_request import NodeRequest

SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


def _wire(sampling: SamplingParams) -> dict[str, Any]:
    return data_plane_wire.request_to_wire(NodeRequest(request_id="r", tenant="t", cache_namespace="ns",
                                                       token_ids=(1, 2), sampling=sampling))


def _round_trip(sampling: SamplingParams) -> SamplingParams:
    return data_plane_wire.request_from_wire(data_plane.unpack(msgpack.packb(_wire(sampling)))).sampling


@pytest.mark.parametrize("spec", [
    None,
    StructuredOutputSpec("json_object"),
    StructuredOutputSpec("json_schema", SCHEMA),
    StructuredOutputSpec("regex", r"\d{3}-[a-z]+"),
    StructuredOutputSpec("choice", json.dumps(["yes", "no", "\u00e9t\u00e9"])),
    StructuredOutputSpec("grammar", 'root ::= "a" | "b"'),
])
def test_every_kind_crosses_the_data_plane_as_kind_and_spec(spec: StructuredOutputSpec | None) -> None:
    sent = SamplingParams(max_tokens=9, structured_output=spec)
    wire = _wire(sent)
    assert wire["sampling"]["structured_output"] == (None if spec is None else [spec.kind, spec.spec])
    received = _round_trip(sent)
    assert received == sent and received.structured_output == spec


def test_a_request_without_the_field_still_decodes() -> None:
    """An older sender that leaves the field out gets the default (off)."""
    wire = _wire(SamplingParams(max_tokens=9))
    del wire["sampling"]["structured_output"]
    assert data_plane_wire.request_from_wire(wire).sampling.structured_output is None


def test_a_spec_at_its_bound_fits_the_request_limits() -> None:
    """A ``MAX_STRUCTURED_SPEC_BYTES`` spec of 4-byte characters decodes within
    ``REQUEST_LIMITS`` (one string, one array of two)."""
    regex = "\U0001f600" * (MAX_STRUCTURED_SPEC_BYTES // 4)
    sent = SamplingParams(max_tokens=9, structured_output=StructuredOutputSpec("regex", regex))
    assert _round_trip(sent) == sent


@pytest.mark.parametrize(("value", "error", "match"), [
    ("json_object", TypeError, "structured_output"),  # a bare string, not [kind, spec]
    ({"kind": "regex", "spec": "a"}, TypeError, "structured_output"),
    (["regex"], TypeError, r"must be \[kind, spec\]"),
    (["regex", "a", "b"], TypeError, r"must be \[kind, spec\]"),
    ([1, "a"], TypeError, "structured_output kind"),
    (["regex", 5], TypeError, "structured_output spec"),
    (["regex", None], TypeError, "structured_output spec"),
    (["regex", b"a"], TypeError, "structured_output spec"),
    (["regex", ["a"]], TypeError, "structured_output spec"),
    (["sql", "select 1"], ValueError, "structured_output kind must be one of"),
    (["json_schema", "[1]"], ValueError, "json_schema must be a JSON object"),
    (["json_schema", "{"], ValueError, "not valid JSON"),
    (["json_schema", "[" * 40 + "]" * 40], ValueError, "nests 40 levels"),
    (["choice", "[]"], ValueError, "at least one choice"),
    (["choice", '["a", "a"]'], ValueError, "twice"),
    (["regex", ""], ValueError, "non-empty spec"),
    (["regex", "a\x00"], ValueError, "NUL"),
    (["json_object", "{}"], ValueError, "takes no spec"),
    (["regex", "a" * (MAX_STRUCTURED_SPEC_BYTES + 1)], ValueError, "bytes; at most"),
])
def test_hostile_wire_values_are_refused_naming_the_field(value: Any, error: type[Exception], match: str) -> None:
    """A mistyped or invalid constraint is a TypeError/ValueError before any ``SamplingParams``
    is built (the node answers INVALID_ARGUMENT "malformed request: ..."), never a request that
    fails in the step."""
    wire = _wire(SamplingParams(max_tokens=9))
    with pytest.raises(error, match=match):
        data_plane_wire.request_from_wire({**wire, "sampling": {**wire["sampling"], "structured_output": value}})
