"""What a request's output must match (structured outputs: vLLM's ``structured_outputs``,
OpenAI's ``response_format``): a JSON object, a JSON schema, a regex, one of some strings, or
an EBNF grammar.

``StructuredOutputSpec`` is the request's part, validated here without the grammar library
(every front end and the engine share it); the engine compiles it with xgrammar and masks
each step's logits to the tokens the grammar allows (``cache_node.grammars``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
"""The kinds a ``StructuredOutputSpec`` may name (vLLM's ``json_object``, ``json``, ``regex``,
``choice``, ``grammar``)."""

MAX_STRUCTURED_SPEC_BYTES = 64 * 1024
"""Longest ``spec`` (UTF-8 bytes). The engine compiles it off the step loop, but compile time
and the compiled grammar's memory grow with it; 64 KiB holds any schema written by hand."""

TOOL_CALLS_KIND = "structural_tag"
"""The kind a ``tool_choice`` "auto" request's constraint takes when its tools are all ``strict``
(``services.chat_tools.auto_constraint``):
its spec is xgrammar's structural tag as JSON text (``{"type": "structural_tag", "format":
{"type": "triggered_tags", ...}}``): free text, and from each trigger (``<tool_call>``) on, one
of the declared tools' calls whose arguments match its parameters' schema. Built by the gateway,
never named by a client: not in ``STRUCTURED_OUTPUT_KINDS`` (the APIs' kinds), taken off the
data plane like them."""

MAX_TOOL_CALLS_SPEC_BYTES = (1 << 20) + (64 << 10)
"""Longest ``TOOL_CALLS_KIND`` spec (UTF-8 bytes): the request's tools (at most
``chat_tools.MAX_TOOLS_CHARS`` characters of JSON, 256 Ki: at most 1 MiB as UTF-8) in the
structural tag's envelope (~150 bytes for each of at most 128 tools), so checked tools always
fit."""

MAX_CHOICES = 256
"""Most strings a ``choice`` spec may list (each one alternative of the compiled grammar)."""

MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of arrays/objects in a ``json_schema`` spec's text. The schema compiler
recurses over it; a 64 KiB ``[[[[...`` would otherwise reach it at depth 32,000."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """A request's output constraint.

    Attributes:
        kind: one of ``STRUCTURED_OUTPUT_KINDS``, or ``TOOL_CALLS_KIND`` (the gateway's
            constraint of a ``tool_choice`` "auto": a structural tag's JSON text, at most
            ``MAX_TOOL_CALLS_SPEC_BYTES``).
        spec: what the kind needs: "" for ``json_object`` (any JSON object); the JSON schema's
            text (a JSON object, at most ``MAX_SCHEMA_DEPTH`` deep) for ``json_schema``; the
            regex for ``regex`` (xgrammar's syntax: ECMAScript-like); a JSON array of 1 to
            ``MAX_CHOICES`` distinct non-empty strings for ``choice``; the EBNF grammar
            (GBNF-style, with a ``root`` rule) for ``grammar``. At most
            ``MAX_STRUCTURED_SPEC_BYTES`` bytes. Whether a regex, a grammar or a schema's
            keywords compile is known only when the engine compiles it (it then finishes the
            request with an error naming ``structured_output``).

    Raises:
        ValueError: an unknown kind, a spec that is not text, too long, empty where the kind
            needs one, not JSON where it must be; the message names ``structured_output``.
    """

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind not in (*STRUCTURED_OUTPUT_KINDS, TOOL_CALLS_KIND):
            raise ValueError(f"structured_output kind must be one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; "
                             f"got {self.kind!r:.60}")
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_output {self.kind} spec must be text, got {type(self.spec).__name__}")  # noqa: TRY004
        try:
            size = len(self.spec.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError(f"structured_output {self.kind} spec is not valid Unicode (a lone surrogate)") from None
        most = MAX_TOOL_CALLS_SPEC_BYTES if self.kind == TOOL_CALLS_KIND else MAX_STRUCTURED_SPEC_BYTES
        if size > most:
            raise ValueError(f"structured_output {self.kind} spec is {size} bytes; at most {most} are allowed")
        if self.kind == "json_object":
            if self.spec:
                raise ValueError("structured_output json_object takes no spec (use json_schema for a schema)")
            return
        if not self.spec.strip():
            raise ValueError(f"structured_output {self.kind} needs a non-empty spec")
        if "\x00" in self.spec:
            raise ValueError(f"structured_output {self.kind} spec holds a NUL character")
        if self.kind == "json_schema":
            _check_schema(self.spec)
        elif self.kind == TOOL_CALLS_KIND:
            _check_structural_tag(self.spec)
        elif self.kind == "choice":
            _check_choices(self.spec)

    @property
    def choices(self) -> tuple[str, ...]:
        """A ``choice`` spec's strings, in order (empty for other kinds)."""
        return tuple(json.loads(self.spec)) if self.kind == "choice" else ()


def _load(kind: str, text: str) -> object:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"structured_output {kind} spec is not valid JSON: {exc!s:.120}") from None


def _depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in JSON ``text``, brackets inside strings left out."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _check_schema(text: str) -> None:
    depth = _depth(text)  # before parsing: json.loads recurses as deep
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"structured_output json_schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH} "
                         "are allowed")
    schema = _load("json_schema", text)
    if not isinstance(schema, dict):
        raise ValueError(f"structured_output json_schema must be a JSON object, got {type(schema).__name__}")  # noqa: TRY004


def _check_structural_tag(text: str) -> None:
    depth = _depth(text)  # a tool's parameters (<= MAX_SCHEMA_DEPTH) under the tag's envelope
    if depth > MAX_SCHEMA_DEPTH + STRUCTURAL_TAG_ENVELOPE_DEPTH:
        raise ValueError(f"structured_output {TOOL_CALLS_KIND} nests {depth} levels deep; at most "
                         f"{MAX_SCHEMA_DEPTH + STRUCTURAL_TAG_ENVELOPE_DEPTH} are allowed")
    tag = _load(TOOL_CALLS_KIND, text)
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag" or not isinstance(tag.get("format"), dict):
        raise ValueError(f'structured_output {TOOL_CALLS_KIND} must be {{"type": "structural_tag", "format": {{...}}}}')


STRUCTURAL_TAG_ENVELOPE_DEPTH = 6
"""Levels a structural tag adds above a tool's parameters' schema (the tag, its format, its tags
list, a tag, its content, the schema's own object)."""


def _check_choices(text: str) -> None:
    if _depth(text) > 1:
        raise ValueError("structured_output choice spec must be a JSON array of strings")
    choices = _load("choice", text)
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError("structured_output choice spec must be a JSON array of strings")
    if not choices:
        raise ValueError("structured_output choice needs at least one choice")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"structured_output choice lists {len(choices)} choices; at most {MAX_CHOICES} are allowed")
    if not all(choices):
        raise ValueError("structured_output choice strings must be non-empty")
    if len(set(choices)) != len(choices):
        raise ValueError("structured_output choice lists a string twice")
