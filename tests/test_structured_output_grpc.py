"""``kvstrata.v1.SamplingParams.structured_output`` (field 17, a ``StructuredOutput`` with one
member of its ``constraint`` oneof) <-> ``StructuredOutputSpec`` in ``services.convert``, and
its bounds before protobuf parses (``services.grpc_wire``). Bad input is a ``ValueError`` whose
message starts with ``sampling.structured_output`` (the gateway's INVALID_ARGUMENT); the served
refusals are in ``test_structured_output_served``."""

from __future__ import annotations

import json
import re

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import (
    MAX_CHOICES,
    MAX_STRUCTURED_SPEC_BYTES,
    StructuredOutputSpec,
)
from kvstrata.v1 import inference_pb2 as pb
from services.convert import sampling_params_from_pb, sampling_params_to_pb
from services.grpc_wire import RequestDecoder, check_wire_shape

SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})


@pytest.mark.parametrize(("constraint", "spec"), [
    (pb.StructuredOutput(json_object=True), StructuredOutputSpec("json_object")),
    (pb.StructuredOutput(json_schema=SCHEMA), StructuredOutputSpec("json_schema", SCHEMA)),
    (pb.StructuredOutput(regex=r"[0-9]{4}"), StructuredOutputSpec("regex", r"[0-9]{4}")),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["oui", "non", "\u00e9t\u00e9"])),
     StructuredOutputSpec("choice", json.dumps(["oui", "non", "\u00e9t\u00e9"], ensure_ascii=False))),
    (pb.StructuredOutput(grammar='root ::= "x"+'), StructuredOutputSpec("grammar", 'root ::= "x"+')),
])
def test_each_member_maps_to_its_spec_and_back(constraint: pb.StructuredOutput, spec: StructuredOutputSpec) -> None:
    msg = pb.SamplingParams(max_tokens=8, structured_output=constraint)
    params = sampling_params_from_pb(msg)
    assert params.structured_output == spec
    assert params.structured_output.choices == tuple(constraint.choice.choices)
    assert sampling_params_to_pb(params).structured_output == constraint
    assert sampling_params_from_pb(sampling_params_to_pb(params)) == params


def test_unset_is_no_constraint_both_ways() -> None:
    params = sampling_params_from_pb(pb.SamplingParams(max_tokens=8))
    assert params.structured_output is None
    assert not sampling_params_to_pb(params).HasField("structured_output")
    assert not sampling_params_to_pb(SamplingParams(max_tokens=8)).HasField("structured_output")


@pytest.mark.parametrize(("constraint", "details"), [
    (pb.StructuredOutput(), ("sampling.structured_output must set one of json_object, json_schema, regex, choice, "
                            "grammar")),
    (pb.StructuredOutput(json_object=False), "sampling.structured_output.json_object must be true"),
    (pb.StructuredOutput(json_schema=""), "sampling.structured_output json_schema needs a non-empty spec"),
    (pb.StructuredOutput(json_schema="[1, 2]"), "sampling.structured_output json_schema must be a JSON object"),
    (pb.StructuredOutput(json_schema="{'a': 1}"), "sampling.structured_output json_schema spec is not valid JSON"),
    (pb.StructuredOutput(json_schema="{\"a\":" + "[" * 40 + "]" * 40 + "}"),
     "sampling.structured_output json_schema nests 41 levels deep"),
    (pb.StructuredOutput(regex="   "), "sampling.structured_output regex needs a non-empty spec"),
    (pb.StructuredOutput(grammar="root ::= \"\x00\""), "sampling.structured_output grammar spec holds a NUL"),
    (pb.StructuredOutput(regex="a" * (MAX_STRUCTURED_SPEC_BYTES + 1)),
     f"sampling.structured_output regex spec is {MAX_STRUCTURED_SPEC_BYTES + 1} bytes; at most"),
    (pb.StructuredOutput(choice=pb.ChoiceList()), "sampling.structured_output choice needs at least one choice"),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", ""])),
     "sampling.structured_output choice strings must be non-empty"),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=["a", "a"])), "sampling.structured_output choice lists a string twice"),
    (pb.StructuredOutput(choice=pb.ChoiceList(choices=[str(i) for i in range(MAX_CHOICES + 1)])),
     f"sampling.structured_output choice lists {MAX_CHOICES + 1} choices"),
])
def test_bad_constraints_are_value_errors_naming_the_field(constraint: pb.StructuredOutput, details: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(details)):
        sampling_params_from_pb(pb.SamplingParams(max_tokens=8, structured_output=constraint))


def test_choices_past_their_bound_are_refused_before_protobuf_parses() -> None:
    """``grpc_wire`` counts ``ChoiceList.choices`` on the wire (``REPEATED_LIMITS``): 257 are
    refused naming the field, 256 pass to the parser."""
    def request(n: int) -> bytes:
        choices = pb.ChoiceList(choices=[str(i) for i in range(n)])
        sampling = pb.SamplingParams(max_tokens=1, structured_output=pb.StructuredOutput(choice=choices))
        return pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]), sampling=sampling).SerializeToString()

    check_wire_shape(request(MAX_CHOICES), pb.GenerateRequest.DESCRIPTOR)
    with pytest.raises(ValueError, match=r"^sampling.structured_output.choice.choices holds more than 256 elements"):
        RequestDecoder(pb.GenerateRequest.FromString)(request(MAX_CHOICES + 1))
