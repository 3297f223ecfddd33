"""CLI errors end with a clear message and a documented exit code, never a traceback (issue 18
fault 9: `kvstrata generate --max-tokens -5` printed a traceback; H11 trial: NOT_FOUND,
ALREADY_EXISTS and INVALID_ARGUMENT from the server exited 2, a usage error's code, while
UNAUTHENTICATED and RESOURCE_EXHAUSTED exited 1).

Exit codes (``cli.output``): 0 done; 1 the command failed (any refusal from the server, or
nothing to talk to); 2 a usage error, as click reports it; 130 Ctrl-C.

Through typer's CliRunner; the gateway, where one is needed, is real (tests.gateway_harness).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import main as cli
from cli.options import MAX_UINT64
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO, serve

ROOT = Path(__file__).resolve().parent.parent
NOWHERE = "127.0.0.1:1"  # nothing listens: a call that got past validation fails UNAVAILABLE


KEY = "kvs_0123456789ab_" + "A" * 43


def _run(*args: str, **env: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args), env={"KVSTRATA_API_KEY": KEY, "KVSTRATA_ADMIN_KEY": KEY,
                                                           "COLUMNS": "1000", **env})
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def _words(output: str) -> str:
    """The output's words (rich's error box and line breaks removed)."""
    return " ".join(output.replace("│", " ").replace("╭", " ").replace("╰", " ").replace("─", " ").split())


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
    (["generate", "hi", "--priority", "1001"], "--priority"),
    (["generate", "hi", *["--stop", "x"] * 5], "--stop"),
    (["generate", "hi", "--stop", "x" * 257], "--stop"),
    (["tenant", "add", "ann", "--slo-class", "gold"], "--slo-class"),
    (["tenant", "add", "ann", "--kv-quota-bytes", str(MAX_UINT64 + 1)], "--kv-quota-bytes"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_out_of_range_options_exit_2_with_the_option_named(args: list[str], option: str) -> None:
    """issue 18 fault 9: an out-of-range option is a usage error naming it, exit 2."""
    code, output = _run(*args, "--gateway", NOWHERE)

    assert code == 2, output
    assert f"Invalid value for '{option}'" in output


def test_server_invalid_argument_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """INVALID_ARGUMENT from the gateway is a one-line error (issue 18 fault 9), exit 1 as any
    refusal from the server (it exited 2, a usage error's code: H11 trial)."""
    with serve(tmp_path) as gw:
        _, key = gw.scheduler.store.register(TenantSpec("ann"))
        result = CliRunner().invoke(cli.app, ["generate", "hi", "--api-key", key, "--gateway", gw.address,
                                              "--max-tokens", str(NODE_INFO["max_model_len"] + 1)])

    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("INVALID_ARGUMENT: "), result.output


@pytest.mark.parametrize("args,status", [
    (["tenant", "show", "nobody"], "NOT_FOUND"), (["tenant", "add", "ann"], "ALREADY_EXISTS"),
    (["tenant", "list"], "UNAUTHENTICATED"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_every_server_refusal_exits_1(tmp_path: Path, args: list[str], status: str) -> None:
    """H11 trial: NOT_FOUND and ALREADY_EXISTS exited 2, UNAUTHENTICATED 1; every refusal from
    the server is now exit 1, one line naming the status (2 is left to usage errors)."""
    with serve(tmp_path) as gw:
        gw.scheduler.store.register(TenantSpec("ann"))
        admin = KEY if status == "UNAUTHENTICATED" else gw.admin_key
        # no tenant key in the environment: `tenant show` would present it (KVSTRATA_API_KEY)
        code, output = _run(*args, "--gateway", gw.address, KVSTRATA_ADMIN_KEY=admin, KVSTRATA_API_KEY=None)  # type: ignore[arg-type]

    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 1, output
    assert len(lines) == 1 and lines[0].startswith(f"{status}: "), output


def test_nothing_to_talk_to_exits_1(tmp_path: Path) -> None:
    """No gateway up (no --gateway, nothing saved) or no admin key: the command failed, exit 1,
    one line saying what to do (it was 2, a usage error's code)."""
    code, output = _run("status", KVSTRATA_STATE_DIR=str(tmp_path))
    assert code == 1 and output.startswith("no gateway address: run `kvstrata up`"), output
    code, output = _run("tenant", "list", "--gateway", NOWHERE, KVSTRATA_STATE_DIR=str(tmp_path),
                        KVSTRATA_ADMIN_KEY="")
    assert code == 1 and output.startswith("no admin key"), output


def test_unreachable_gateway_is_one_line_and_exit_1() -> None:
    """issue 18 fault 9: a server-side failure is one line too (exit 1: not an input error)."""
    code, output = _run("generate", "hi", "--gateway", NOWHERE)

    lines = [line for line in output.splitlines() if line.strip()]
    assert code == 1, output
    assert len(lines) == 1 and lines[0].startswith("UNAVAILABLE: "), output


@pytest.mark.parametrize("text,message", [
    ("num_cache_nodes: -1\n", "num_cache_nodes: Input should be greater than or equal to 1"),
    ("num_cache_nodes: [\n", "not valid YAML: expected the node content, but found '<stream end>' (line 2, column 1)"),
    ("no_such_key: 1\n", "no_such_key: Extra inputs are not permitted"),
    ("scheduler: edf\n", "scheduler: unknown"),
])
def test_up_with_a_bad_config_is_a_usage_error(tmp_path: Path, text: str, message: str) -> None:
    """issue 18 fault 9: a malformed or out-of-range service config names the file and the
    field; it is a bad ``--config`` value, reported by click as a usage error (exit 2), with
    no pydantic "Value error, " text."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)

    code, output = _run("up", "--config", str(path))

    assert code == 2, output
    assert f"Invalid value for '--config': {path}: " in _words(output) and message in _words(output), output


def test_up_with_a_config_that_is_not_utf8_is_a_usage_error(tmp_path: Path) -> None:
    """Regression (s39 review r3 of 3baa6c6): a config saved in Latin-1 (an "é" in a comment)
    ended ``kvstrata up`` with a UnicodeDecodeError, exit 1; it is a bad ``--config`` value
    saying what and where, as a YAML error is."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes("num_cache_nodes: 1\n# caf\u00e9\n".encode("latin-1"))

    code, output = _run("up", "--config", str(path))

    assert code == 2, output
    assert (f"Invalid value for '--config': {path}: not UTF-8 text: byte 0xe9 (line 2, column 6)"
            in _words(output)), output
    assert "Value error" not in output


def test_up_with_a_missing_config_is_a_usage_error() -> None:
    """issue 18 fault 9: a config path that does not exist is a usage error, exit 2."""
    code, output = _run("up", "--config", "/nonexistent/kvstrata.yaml")

    assert code == 2, output
    assert "Invalid value for '--config'" in output


def test_a_deepresearch_plan_without_a_session_is_refused_before_anything_runs(tmp_path: Path) -> None:
    """A fresh-user trial: `kvstrata run deepresearch --duration 20 --tenants 2 --max-subagents 2`
    printed "DeepResearch plan: 0 sessions, 0 calls", empty tables, wrote an empty report folder
    and exited 1. Under seed 0 no session arrives in 20 s (2.2 expected; the first at ~45 s): the
    command now says so in one line with the numbers, before it connects (nothing listens at
    NOWHERE: a connection would fail UNAVAILABLE, exit 1), writes nothing, and exits 2."""
    reports = tmp_path / "reports"
    code, output = _run("run", "deepresearch", "--duration", "20", "--tenants", "2", "--max-subagents", "2",
                        "--gateway", NOWHERE, "--reports", str(reports))
    assert code == 2, output
    assert len(output.strip().splitlines()) == 1, output
    words = _words(output)
    for part in ("--duration 20 s", "--sessions-per-s 0.054", "2 tenant shares", "2.2 sessions",
                 "--seed 0", "raise --duration (45 gives one) or --sessions-per-s"):
        assert part in words, words
    assert "UNAVAILABLE" not in words and not reports.exists()
    code, output = _run("run", "deepresearch", "--duration", "45", "--tenants", "2", "--gateway", NOWHERE,
                        "--reports", str(reports))
    # 45 s has a session: it goes on to connect, and the failed connection is one line, exit 1
    # (registering the tenants raised AioRpcError out of asyncio.run: a traceback)
    assert code == 1 and output.startswith("UNAVAILABLE:") and len(output.strip().splitlines()) == 1, output


def test_every_unary_cli_call_has_a_deadline() -> None:
    """Regression (review 23d, D): the tenant commands' calls had no deadline, so one against a
    gateway that accepts and never answers hung for good. Every unary stub call of the CLI passes
    ``timeout=`` (``Generate``, a stream the user watches and ends, excepted)."""
    import ast

    missing = []
    for path in sorted((Path(__file__).resolve().parent.parent / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr[:1].isupper()
                    and any(k.arg == "metadata" for k in node.keywords) and node.func.attr != "Generate"
                    and not any(k.arg == "timeout" for k in node.keywords)):
                missing.append(f"{path.name}:{node.lineno} {node.func.attr}")
    assert not missing, missing


def test_a_tenants_own_key_may_come_from_the_environment() -> None:
    """Regression (review 23d, D): `tenant show` / `rotate-key` took the tenant's key only as
    --api-key, visible to every local user in ps; KVSTRATA_API_KEY now gives it too."""
    from cli.tenant import OwnKeyOpt

    assert OwnKeyOpt.envvar == "KVSTRATA_API_KEY"


def test_an_id_that_is_not_text_is_a_usage_error() -> None:
    """A session id or ``--cache-salt`` of bytes the locale cannot decode (``$'a\\xffb'`` in a
    shell: Python keeps them as lone surrogates) is a usage error naming it, exit 2, before
    anything is called. Regression (review r1 F5, session 37): UnicodeEncodeError, a
    traceback with exit 1. Through the real CLI process, given the bytes as a shell gives them."""
    env = {**os.environ, "KVSTRATA_API_KEY": KEY, "LC_ALL": "C.UTF-8", "COLUMNS": "1000"}
    base = [sys.executable.encode(), b"-m", b"cli.main"]
    for args, option in [([b"close-session", b"s1", b"--cache-salt", b"a\xffb"], "--cache-salt"),
                         ([b"close-session", b"a\xffb"], "SESSION"),
                         ([b"generate", b"hi", b"--session", b"a\xffb"], "--session"),
                         ([b"generate", b"hi", b"--cache-salt", b"a\xffb"], "--cache-salt")]:
        done = subprocess.run([*base, *args, b"--gateway", NOWHERE.encode()], cwd=ROOT, env=env, check=False,
                              capture_output=True, timeout=60)
        output = _words((done.stdout + done.stderr).decode("utf-8", "replace"))
        assert done.returncode == 2 and "Traceback" not in output, (args, done.returncode, output[-600:])
        assert f"Invalid value for '{option}'" in output or f"Invalid value for {option}" in output, (args, output)
        assert "not valid UTF-8 text" in output, output


@pytest.mark.parametrize("args,option", [
    (["generate", "hi", "--session", "s\nx"], "--session"),
    (["generate", "hi", "--cache-salt", "a\x1b[2Jb"], "--cache-salt"),
    (["close-session", "s\u202ex"], "SESSION"),
    (["close-session", "s1", "--cache-salt", "a\tb"], "--cache-salt"),
])
def test_an_id_holding_a_character_no_client_id_may_is_a_usage_error(args: list[str], option: str) -> None:
    """A session id or ``--cache-salt`` holding a control, line-break or bidirectional formatting
    character (``services.client_ids``, the gateway's rule) is a usage error naming the option,
    exit 2, before anything is called. Regression (review r5, session 40): it went to the
    gateway and came back as its INVALID_ARGUMENT with exit 1 (here: UNAVAILABLE, nothing
    listens)."""
    code, output = _run(*args, "--gateway", NOWHERE)
    words = _words(output)
    assert code == 2, (code, words)
    assert f"Invalid value for '{option}'" in words or f"Invalid value for {option}" in words, words
    assert "bidirectional formatting character" in words, words
