"""``KVSTRATA_API_KEY`` / ``--api-key`` as a user pastes it: a line's newline or surrounding
spaces are no part of the key; whitespace, a control character or one past ASCII inside it is a usage error
(exit 2) said in words, before any call (a real gRPC server listens, serving nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from typer.testing import CliRunner

from cli import main as cli

KEY = "kvs_0123456789ab_" + "A" * 43


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """A gRPC server with no services: every call it receives is UNIMPLEMENTED."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _run(gateway: str, key: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli.app, list(args), env={"KVSTRATA_GATEWAY": gateway, "KVSTRATA_API_KEY": key,
                                                          "COLUMNS": "1000"})
    return result.exit_code, result.output


COMMANDS = [("generate", "hi", "--max-tokens", "2"), ("close-session", "s1"), ("tenant", "show", "ann")]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("key", [f"{KEY}\n", f"  {KEY} \n"])
def test_a_pasted_lines_newline_and_spaces_are_no_part_of_the_key(gateway: str, key: str, command: tuple) -> None:
    """Regression (s39 fresh-user trial): a key ending in a newline made every command end
    "INTERNAL: Invalid metadata", exit 1, as if the server had failed (gRPC's C core refused the
    header before sending). Now the key is sent without it: the call reaches the server."""
    code, out = _run(gateway, key, *command)
    assert code == 1 and "UNIMPLEMENTED" in out, out
    assert "Invalid metadata" not in out


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("key", [f"{KEY[:20]}\n{KEY[20:]}", f"{KEY[:20]} {KEY[20:]}", f"{KEY}\x1b", " \n",
                                 # regression (s39 review r3): characters past ASCII (a key pasted
                                 # with typographic quotes) were sent: "INTERNAL: Invalid metadata"
                                 f"\u201c{KEY}\u201d", f"{KEY[:-1]}\u00e9"])
def test_a_key_holding_whitespace_or_control_characters_is_a_usage_error(gateway: str, key: str,
                                                                          command: tuple) -> None:
    code, out = _run(gateway, key, *command)
    assert code == 2, out
    assert "the API key is empty or holds whitespace, a control character or one past ASCII" in out and "Traceback" not in out, out
