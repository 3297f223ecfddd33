"""``kvstrata generate`` sends structured outputs, ``--logit-bias`` and ``--allowed-token-id``
(``cli.constraints``). Before, the CLI had no flag for any of them although the gRPC API takes
all three (``SamplingParams`` fields 15-17). Served end to end on the real node (xgrammar),
scheduler and gateway of ``test_logprobs_served`` (a tiny random Llama, SmolLM2's tokenizer);
bad values are usage errors (exit 2) before any call, with the server's own bounds."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli.constraints import constraints
from kvstrata.v1 import inference_pb2 as pb
from tests.test_logprobs_served import Served

REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def kvstrata(served: Served, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, ["generate", "Answer.", "--max-tokens", "40", *args,
                                          "--gateway", served.address], env={"KVSTRATA_API_KEY": served.key})
    return result.exit_code, result.output


def answer(output: str) -> str:
    """The streamed text: everything before the closing line (``finish_line``)."""
    return output.rsplit("\n", 2)[0] if output.count("\n") >= 2 else ""


def test_regex_and_choice_answers_match(served: Served) -> None:
    code, out = kvstrata(served, "--regex", REGEX)
    assert code == 0 and "stop:" in out, out
    assert re.fullmatch(REGEX, answer(out)), out
    code, out = kvstrata(served, "--choice", "blue", "--choice", "green", "--temperature", "1")
    assert code == 0 and answer(out) in ("blue", "green"), out


def test_json_schema_from_a_file_and_allowed_token_ids(served: Served, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
                                  "required": ["n"], "additionalProperties": False}))
    # no whitespace-only token may be drawn: the tiny random model would fill the JSON with it
    tok = served.tokenizer
    allowed = sorted({t for text in ('{"n":', "{", '"', "n", ":", "}", *map(str, range(10)))
                      for t in tok.encode(text, add_special_tokens=False)})
    code, out = kvstrata(served, "--json-schema", f"@{schema}",
                         *[a for t in allowed for a in ("--allowed-token-id", str(t))])
    assert code == 0 and "stop:" in out, out
    assert 0 <= json.loads(answer(out))["n"] <= 9


def test_logit_bias_bans_the_greedy_first_token(served: Served) -> None:
    _, free = kvstrata(served, "--max-tokens", "1")
    first = served.tokenizer.encode(answer(free), add_special_tokens=False)[0]
    code, out = kvstrata(served, "--max-tokens", "1", "--logit-bias", f"{first}=-100")
    assert code == 0 and answer(out) != answer(free), (free, out)


def test_the_fields_reach_sampling_params() -> None:
    c = constraints(False, None, None, ["a", "b"], None, ["13=-100", "7=2.5"], [9, 3])
    sampling = pb.SamplingParams(max_tokens=4)
    c.apply(sampling)
    assert dict(sampling.logit_bias) == {13: -100.0, 7: 2.5} and list(sampling.allowed_token_ids) == [3, 9]
    assert list(sampling.structured_output.choice.choices) == ["a", "b"]
    sampling = pb.SamplingParams()
    constraints(True, None, None, None, None, None, None).apply(sampling)
    assert sampling.structured_output.json_object


@pytest.mark.parametrize(("args", "says"), [
    (("--json", "--regex", "a+"), "give one structured output, got --json and --regex"),
    (("--json-schema", "[1]"), "must be a JSON object"),
    (("--json-schema", "@/nonexistent/schema.json"), "cannot read"),
    (("--logit-bias", "13=200"), "in [-100, 100]"),
    (("--logit-bias", "13=200"), "Invalid value for --logit-bias"),  # (trial 28k: named no option)
    (("--allowed-token-id", "-1"), "Invalid value for --allowed-token-id"),
    (("--regex", "   "), "Invalid value for --regex"),
    (("--logit-bias", "13"), "expected TOKEN_ID=BIAS"),
    (("--regex", "   "), "needs a non-empty spec"),
])
def test_bad_values_are_usage_errors_before_any_call(args: tuple[str, ...], says: str) -> None:
    result = CliRunner().invoke(cli.app, ["generate", "hi", *args, "--gateway", "127.0.0.1:1"],
                                env={"KVSTRATA_API_KEY": "k"})
    assert result.exit_code == 2, result.output
    assert says in " ".join(result.output.replace("│", " ").split()), result.output  # (rich wraps it in a box)
