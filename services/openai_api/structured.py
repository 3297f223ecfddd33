"""Structured outputs in the OpenAI API's bodies: what the generated text must match, as
``SamplingParams.structured_output`` (``cache_node.structured_output.StructuredOutputSpec``;
the node compiles it with xgrammar and masks each step's logits).

A body may give one constraint, in any of these shapes (both endpoints, every choice of ``n``):

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any
  JSON object), ``{"type": "json_schema", "json_schema": {"name", "schema", "description",
  "strict"}}`` (a JSON value the schema validates; ``name`` as OpenAI's pattern
  ``^[a-zA-Z0-9_-]{1,64}$``; ``schema`` is required here, as vLLM requires it; the output is
  constrained whatever ``strict`` says);
- vLLM's extra ``structured_outputs``: one of ``json`` (a schema, as an object or its text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF) and ``json_object`` (true);
- vLLM's older extras ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (vLLM itself no longer declares them and ignores them; here they constrain, as they did).

Two constraints in one body are a 400 naming the fields (``structured_output``), a bad one a
400 naming its field (the validators here); a schema more than 32 levels deep, past 64 KiB as
text, or not a JSON object, and the ``StructuredOutputSpec`` refusals (empty, NUL, duplicate
choices) too. Whether a regex or a grammar compiles is known on the node, which refuses the
request (400) with the compiler's message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from cache_node.structured_output import MAX_CHOICES, StructuredOutputSpec
from services.openai_api.strict import Strict, bounded_list
from services.tool_requests import spec_of

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's older extras, each one constraint kind (``guided_kind``)."""

_GUIDED_KINDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_VLLM_KINDS = {"json_": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# spec_of: a constraint's value as a StructuredOutputSpec, one copy for both APIs' tool choices
# and the structured-output fields here (``services.tool_requests``)


class JsonSchema(Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output is constrained either way

    @field_validator("schema_")
    @classmethod
    def _usable(cls, value: dict[str, Any]) -> dict[str, Any]:
        spec_of("json_schema", value)
        return value

    def spec(self) -> StructuredOutputSpec:
        return spec_of("json_schema", self.schema_)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchema


def _format_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return {"text": "Text", "json_object": "JsonObject", "json_schema": "JsonSchema"}.get(kind)  # type: ignore[arg-type]


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("Text")] | Annotated[JsonObjectFormat, Tag("JsonObject")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchema")],
    Discriminator(_format_tag, custom_error_type="invalid_format",
                  custom_error_message='type must be "text", "json_object" or "json_schema"'),
]
"""OpenAI's ``response_format`` (its tags are capitalized: ``errors`` leaves them out of a 400's
``param``)."""


def response_format_spec(value: TextFormat | JsonObjectFormat | JsonSchemaFormat) -> StructuredOutputSpec | None:
    if isinstance(value, JsonSchemaFormat):
        return value.json_schema.spec()
    return StructuredOutputSpec("json_object") if isinstance(value, JsonObjectFormat) else None


class StructuredOutputs(Strict):
    """vLLM's extra ``structured_outputs``: exactly one constraint (vLLM's other options, such
    as ``whitespace_pattern``, are refused as unsupported fields)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: bounded_list(str) | None = None  # type: ignore[valid-type]
    grammar: str | None = None
    json_object: bool | None = None

    @field_validator("choice", mode="before")
    @classmethod
    def _few_choices(cls, value: Any) -> Any:
        return few_choices(value)

    @field_validator("json_", "regex", "choice", "grammar")
    @classmethod
    def _usable(cls, value: Any, info: ValidationInfo) -> Any:
        spec_of(_VLLM_KINDS[info.field_name or ""], value)
        return value

    @field_validator("json_object")
    @classmethod
    def _true(cls, value: bool) -> bool:
        if not value:
            raise ValueError("must be true (leave structured_outputs out for no constraint)")
        return value

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"must give exactly one of json, regex, choice, grammar, json_object; got "
                             f"{', '.join(n.rstrip('_') for n in given) or 'none'}")
        return self

    def spec(self) -> StructuredOutputSpec:
        if self.json_object:
            return StructuredOutputSpec("json_object")
        name, value = next((n, v) for n, v in (("json_", self.json_), ("regex", self.regex), ("choice", self.choice),
                                               ("grammar", self.grammar)) if v is not None)
        return spec_of(_VLLM_KINDS[name], value)


def few_choices(value: Any) -> Any:
    """A choice list past ``MAX_CHOICES`` is refused before its strings are validated."""
    if isinstance(value, list) and len(value) > MAX_CHOICES:
        raise ValueError(f"lists {len(value)} choices; at most {MAX_CHOICES} are allowed")
    return value


class StructuredFields(Strict):
    """The structured-output fields of both endpoints' bodies (their base), and the one
    constraint they give."""

    response_format: ResponseFormat | None = None  # OpenAI's
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None  # vLLM's older extras
    guided_regex: str | None = None
    guided_choice: bounded_list(str) | None = None  # type: ignore[valid-type]
    guided_grammar: str | None = None

    @field_validator("guided_choice", mode="before")
    @classmethod
    def _few_choices(cls, value: Any) -> Any:
        return few_choices(value)

    @field_validator(*GUIDED_FIELDS)
    @classmethod
    def _usable(cls, value: Any, info: ValidationInfo) -> Any:
        spec_of(_GUIDED_KINDS[info.field_name or ""], value)
        return value

    def constraint_fields(self) -> list[str]:
        """The fields that give a constraint (``response_format`` text gives none)."""
        return [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
                if getattr(self, name) is not None
                and not (name == "response_format" and isinstance(self.response_format, TextFormat))]

    def constraint_field(self) -> str | None:
        """The field that gives the body's constraint, None for none."""
        return next(iter(self.constraint_fields()), None)

    def constraint_path(self) -> str | None:
        """The path of the value that gives the body's constraint, as a 400 about it names it
        (``param``): ``response_format.json_schema.schema``, ``structured_outputs.regex`` (the
        one given), a ``guided_*`` field; None for none. Regression (trial 29k P3): a spec the
        node's compiler refused named only the top-level field (``structured_outputs``,
        ``response_format``), not the path README gives."""
        field = self.constraint_field()
        if field == "response_format" and isinstance(self.response_format, JsonSchemaFormat):
            return "response_format.json_schema.schema"
        if field == "structured_outputs" and self.structured_outputs is not None:
            given = next((name for name in ("json_", "regex", "choice", "grammar", "json_object")
                          if getattr(self.structured_outputs, name) is not None), None)
            return f"structured_outputs.{given.rstrip('_')}" if given else field
        return field

    def structured_output(self) -> StructuredOutputSpec | None:
        """The one constraint given, None for none (``response_format`` text is none).

        Raises:
            ValueError: naming the first of the fields, when more than one is given.
        """
        given = self.constraint_fields()
        if len(given) > 1:
            raise ValueError(f"{given[0]}: give one structured output constraint, not {len(given)} (got "
                             f"{' and '.join(given)})")
        if not given:
            return None
        value = getattr(self, given[0])
        if given[0] == "response_format":
            return response_format_spec(value)
        if given[0] == "structured_outputs":
            return value.spec()  # type: ignore[no-any-return]
        return spec_of(_GUIDED_KINDS[given[0]], value)
