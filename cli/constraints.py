"""``kvstrata generate``'s output constraints: structured outputs (``--json``, ``--json-schema``,
``--regex``, ``--choice``, ``--grammar``), ``--logit-bias`` and ``--allowed-token-id``.

Each is checked here with the server's own rules (``StructuredOutputSpec`` and
``SamplingParams``, the bounds the node applies), so a bad value is a usage error (exit 2)
before any call; whether a regex, grammar or schema compiles is known only on the node (its
INVALID_ARGUMENT names ``sampling.structured_output``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import typer

from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import MAX_STRUCTURED_SPEC_BYTES, StructuredOutputSpec
from kvstrata.v1 import inference_pb2
from services.convert import structured_output_to_pb

KINDS = {"--json": "json_object", "--json-schema": "json_schema", "--regex": "regex", "--choice": "choice",
         "--grammar": "grammar"}
"""Each structured-output option's ``StructuredOutputSpec`` kind."""

FILE_PREFIX = "@"
"""``--json-schema @schema.json`` and ``--grammar @rules.ebnf`` read the file (as curl's ``-d @file``)."""


@dataclass(frozen=True)
class Constraints:
    """What the options asked for, checked: ``structured_output`` (None: no constraint),
    ``logit_bias`` as (token id, bias) pairs sorted by id, ``allowed_token_ids`` sorted."""

    structured_output: StructuredOutputSpec | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()

    def apply(self, sampling: inference_pb2.SamplingParams) -> None:
        """Set them on ``sampling`` (fields 15, 16 and 17 of ``kvstrata.v1.SamplingParams``)."""
        sampling.logit_bias.update(dict(self.logit_bias))
        sampling.allowed_token_ids.extend(self.allowed_token_ids)
        if self.structured_output is not None:
            sampling.structured_output.CopyFrom(structured_output_to_pb(self.structured_output))


NO_CONSTRAINTS = Constraints()


def spec_text(option: str, value: str, max_bytes: int = MAX_STRUCTURED_SPEC_BYTES) -> str:
    """``value``, or the UTF-8 text of the file ``value`` names after ``@``, at most
    ``max_bytes`` long. Raises ``typer.BadParameter`` naming ``option`` for a file that cannot
    be read or is too large."""
    if not value.startswith(FILE_PREFIX):
        return value
    path = Path(value[len(FILE_PREFIX):]).expanduser()
    try:
        if path.stat().st_size > max_bytes:
            raise typer.BadParameter(f"{path} is over {max_bytes} bytes", param_hint=option)
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc}", param_hint=option) from None


def logit_bias_pairs(values: list[str]) -> list[tuple[int, float]]:
    """``ID=BIAS`` strings as (id, bias) pairs. Raises ``typer.BadParameter`` for another form."""
    pairs = []
    for value in values:
        token, sep, bias = value.partition("=")
        try:
            if not sep:
                raise ValueError
            pairs.append((int(token), float(bias)))
        except ValueError:
            raise typer.BadParameter(f"expected TOKEN_ID=BIAS (e.g. 13=-100), got {value!r:.60}",
                                     param_hint="--logit-bias") from None
    return pairs


def constraints(json_object: bool, json_schema: str | None, regex: str | None, choice: list[str] | None,
                grammar: str | None, logit_bias: list[str] | None,
                allowed_token_ids: list[int] | None) -> Constraints:
    """The checked constraints of one ``generate`` call (at most one structured output).

    Raises:
        typer.BadParameter: two structured outputs, or a value the server would refuse
            (a schema that is not a JSON object, too long, a bias outside [-100, 100], ...).
    """
    given = {"--json": "" if json_object else None, "--json-schema": json_schema, "--regex": regex,
             "--choice": json.dumps(choice, ensure_ascii=False) if choice else None, "--grammar": grammar}
    chosen = [option for option, value in given.items() if value is not None]
    if len(chosen) > 1:
        raise typer.BadParameter(f"give one structured output, got {' and '.join(chosen)}")
    spec = None
    if chosen:
        option = chosen[0]
        try:
            spec = StructuredOutputSpec(KINDS[option], spec_text(option, given[option] or ""))
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=option) from None
    fields = {"--logit-bias": {"logit_bias": logit_bias_pairs(logit_bias or [])},
              "--allowed-token-id": {"allowed_token_ids": list(allowed_token_ids) if allowed_token_ids else None}}
    checked = {}
    for option, field in fields.items():  # each checked alone, so an error names its option
        try:
            checked[option] = SamplingParams(**field)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint=option) from None
    return Constraints(spec, checked["--logit-bias"].logit_bias,
                       checked["--allowed-token-id"].allowed_token_ids or ())
