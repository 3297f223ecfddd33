"""StructuredOutputSpec validation and SamplingParams.structured_output (no grammar library)."""

from __future__ import annotations

import json

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import (
    MAX_CHOICES,
    MAX_SCHEMA_DEPTH,
    MAX_STRUCTURED_SPEC_BYTES,
    StructuredOutputSpec,
)

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("kind, spec", [
    ("json_object", ""),
    ("json_schema", SCHEMA),
    ("regex", r"[0-9]{3}-[a-z]+"),
    ("choice", json.dumps(["yes", "no", "maybe \"so\""])),
    ("grammar", 'root ::= "a" | "b"'),
])
def test_valid_specs_are_kept_as_given(kind: str, spec: str) -> None:
    s = StructuredOutputSpec(kind, spec)
    assert (s.kind, s.spec) == (kind, spec)
    assert SamplingParams(structured_output=s).structured_output is s


def test_choices_are_read_in_order() -> None:
    assert StructuredOutputSpec("choice", '["b", "a"]').choices == ("b", "a")
    assert StructuredOutputSpec("regex", "a").choices == ()


@pytest.mark.parametrize("kind, spec, needle", [
    ("json", "", "kind must be one of json_object, json_schema, regex, choice, grammar"),
    ("json_object", "{}", "json_object takes no spec"),
    ("json_schema", "", "needs a non-empty spec"),
    ("regex", "   ", "needs a non-empty spec"),
    ("grammar", "", "needs a non-empty spec"),
    ("json_schema", "{not json", "json_schema spec is not valid JSON"),
    ("json_schema", "[1]", "json_schema must be a JSON object, got list"),
    ("json_schema", "true", "json_schema must be a JSON object, got bool"),
    ("json_schema", "[" * (MAX_SCHEMA_DEPTH + 1) + "]" * (MAX_SCHEMA_DEPTH + 1), "nests 33 levels deep"),
    ("choice", "yes", "choice spec is not valid JSON"),
    ("choice", '{"a": 1}', "JSON array of strings"),
    ("choice", '["a", 1]', "JSON array of strings"),
    ("choice", '[["a"]]', "JSON array of strings"),
    ("choice", "[]", "at least one choice"),
    ("choice", '["a", ""]', "choice strings must be non-empty"),
    ("choice", '["a", "a"]', "lists a string twice"),
    ("choice", json.dumps([str(i) for i in range(MAX_CHOICES + 1)]), f"257 choices; at most {MAX_CHOICES}"),
    ("regex", "a\x00b", "holds a NUL character"),
    ("regex", "a\ud800", "not valid Unicode"),
    ("regex", "a" * (MAX_STRUCTURED_SPEC_BYTES + 1), f"65537 bytes; at most {MAX_STRUCTURED_SPEC_BYTES}"),
    ("grammar", "\u00e9" * (MAX_STRUCTURED_SPEC_BYTES // 2 + 1), "65538 bytes"),  # bytes, not characters
])
def test_bad_specs_are_refused_naming_the_problem(kind: str, spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match="structured_output") as err:
        StructuredOutputSpec(kind, spec)
    assert needle in str(err.value)


def test_spec_must_be_text_and_params_take_only_a_spec() -> None:
    with pytest.raises(ValueError, match="regex spec must be text, got bytes"):
        StructuredOutputSpec("regex", b"a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="structured_output must be a StructuredOutputSpec or None, got dict"):
        SamplingParams(structured_output={"kind": "regex", "spec": "a"})  # type: ignore[arg-type]
    assert SamplingParams().structured_output is None


def test_spec_at_the_bounds_is_accepted() -> None:
    StructuredOutputSpec("regex", "a" * MAX_STRUCTURED_SPEC_BYTES)
    StructuredOutputSpec("choice", json.dumps([str(i) for i in range(MAX_CHOICES)]))
    deep = '{"a":' * (MAX_SCHEMA_DEPTH - 1) + "{}" + "}" * (MAX_SCHEMA_DEPTH - 1)
    StructuredOutputSpec("json_schema", deep)
    # brackets inside strings are not nesting
    StructuredOutputSpec("json_schema", json.dumps({"description": "[" * 100}))
