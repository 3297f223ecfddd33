"""The command ``kvstrata generate`` prints after a reply's tool calls is served by a default gateway.

Regression (s41 new-user walkthrough): after ``kvstrata generate ... --tools @tools.json
--tool-choice get_weather --session tl`` the CLI printed "send each result back with: kvstrata
generate --session tl --tools ... --tool-result ID=RESULT"; run so on a plain ``kvstrata up``
(``tool_call_parser`` off, the default) it ended "INVALID_ARGUMENT: tool_choice: "auto" (the
default when tools are given) needs the server's tool call parser". Now the printed command
names ``--tool-choice none``. The CLI runs against a gRPC server that records the request; the
request it sent goes through the gateway's own check (``gateway_inputs.input_from_pb`` with
the default config's ``tool_call_parser``).
"""

from __future__ import annotations

import json
import shlex
from concurrent import futures
from pathlib import Path

import grpc
from typer.testing import CliRunner

from cli import main as cli
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services.config import ServiceConfig
from services.gateway_inputs import input_from_pb


class _ToolCalling(inference_pb2_grpc.InferenceServiceServicer):
    """Keeps each request; answers the first with one tool call, the others with text."""

    def __init__(self) -> None:
        self.requests: list[inference_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if len(self.requests) == 1:
            call = inference_pb2.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
            yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(
                finish_reason="tool_calls", tool_calls=[call]))
            return
        yield inference_pb2.GenerateResponse(delta=inference_pb2.GenerateDelta(text="Sunny."))
        yield inference_pb2.GenerateResponse(finished=inference_pb2.GenerateFinished(finish_reason="stop"))


def test_the_printed_results_command_passes_the_default_gateways_check(tmp_path: Path) -> None:
    """The first call names its function; the hint's command, run with the tools file and the
    call's id filled in, sends the tool result with tool_choice none, which the gateway's check
    with ``tool_call_parser`` "" takes (before: unset, i.e. "auto", refused)."""
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]))
    server, servicer = grpc.server(futures.ThreadPoolExecutor(max_workers=2)), _ToolCalling()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    env = {"KVSTRATA_API_KEY": "k", "COLUMNS": "1000"}
    gateway = ["--gateway", f"127.0.0.1:{port}"]
    try:
        first = CliRunner().invoke(cli.app, ["generate", "Weather in Paris?", "--session", "tl", "--tools",
                                             f"@{tools}", "--tool-choice", "get_weather", *gateway], env=env)
        assert first.exit_code == 0, first.output
        [hint] = [line for line in first.output.splitlines() if line.startswith("send each result back with: ")]
        argv = shlex.split(hint.removeprefix("send each result back with: ").partition(" (ID=@FILE")[0])
        argv[argv.index("...")] = f"@{tools}"
        argv[argv.index("ID=RESULT")] = "call_1=Sunny, 21 C"
        second = CliRunner().invoke(cli.app, [*argv[1:], *gateway], env=env)
    finally:
        server.stop(grace=None)
    assert second.exit_code == 0, second.output
    sent = servicer.requests[1]
    assert [(m.role, m.tool_call_id, m.content) for m in sent.chat.messages] == [("tool", "call_1", "Sunny, 21 C")]
    checked = input_from_pb(sent, tool_call_parser=ServiceConfig().tool_call_parser)  # raised ValueError before
    assert checked.session_id == "tl" and checked.sampling.structured_output is None
