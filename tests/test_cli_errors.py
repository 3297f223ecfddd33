"""CLI input errors end with a clear message and exit code 2, never a traceback (issue 18
fault 9: `kvstrata generate --max-tokens -5` printed a traceback).

Through typer's CliRunner; the gateway, where one is needed, is real (tests.gateway_harness).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, serve

NOWHERE = "127.0.0.1:1"  # nothing listens: a call that got past validation fails UNAVAILABLE


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args), env={"KVSTRATA_API_KEY": "kvs_0123456789ab_" + "A" * 43,
                                                           "KVSTRATA_ADMIN_KEY": "kvs_0123456789ab_" + "A" * 43})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result.exit_code, result.output


@pytest.mark.parametrize("args,option", [
    (["generate", "hi", "--max-tokens", "-5"], "--max-tokens"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--max-tokens", str(2**32)], "--max-tokens"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["tenant", "add", "ann", "--kv-quota-bytes", "-1"], "--kv-quota-bytes"),
    (["tenant", "add", "ann", "--max-context-tokens", "-3"], "--max-context-tokens"),
    (["tenant", "add", "ann", "--weight", "-1"], "--weight"),
    (["tenant", "add", "ann", "--ttft-slo-ms", "-1"], "--ttft-slo-ms"),
    (["run", "deepresearch", "--tenants", "0"], "--tenants"),
    (["run", "deepresearch", "--duration", "-1"], "--duration"),
    (["run", "deepresearch", "--max-subagents", "9"], "--max-subagents"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_out_of_range_options_exit_2_with_the_option_named(args: list[str], option: str) -> None:
    """issue 18 fault 9: an out-of-range option is a usage error naming it, exit 2."""
    code, output = _run(*args, "--gateway", NOWHERE)

    assert code == 2, output
    assert f"Invalid value for '{option}'" in output


def test_server_invalid_argument_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """issue 18 fault 9: INVALID_ARGUMENT from the gateway is a one-line error, exit 2."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann"))
        result = CliRunner().invoke(cli.app, ["generate", "hi", "--api-key", key, "--gateway", gw.address,
                                              "--max-tokens", str(NODE_INFO["max_model_len"] + 1)])

    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("INVALID_ARGUMENT: "), result.output


def test_unreachable_gateway_is_one_line_and_exit_1() -> None:
    """issue 18 fault 9: a server-side failure is one line too (exit 1: not an input error)."""
    code, output = _run("generate", "hi", "--gateway", NOWHERE)

    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 1, output
    assert len(lines) == 1 and lines[0].startswith("UNAVAILABLE: "), output


@pytest.mark.parametrize("text,message", [
    ("num_cache_nodes: -1\n", "num_cache_nodes: Input should be greater than or equal to 1"),
    ("num_cache_nodes: [\n", "while parsing a flow"),
    ("no_such_key: 1\n", "no_such_key: Extra inputs are not permitted"),
])
def test_up_with_a_bad_config_exits_2_with_one_line(tmp_path: Path, text: str, message: str) -> None:
    """issue 18 fault 9: a malformed or out-of-range service config is one line, exit 2."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)

    code, output = _run("up", "--config", str(path))

    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 2, output
    assert len(lines) == 1 and message in lines[0], output


def test_up_with_a_missing_config_is_a_usage_error() -> None:
    """issue 18 fault 9: a config path that does not exist is a usage error, exit 2."""
    code, output = _run("up", "--config", "/nonexistent/kvstrata.yaml")

    assert code == 2, output
    assert "Invalid value for '--config'" in output
