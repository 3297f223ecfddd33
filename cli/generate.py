"""``kvstrata generate``: stream one chat completion to the terminal."""

from __future__ import annotations

import grpc
import typer

from cli.options import MAX_UINT32, finite
from cli.output import console, fail
from cli.state import gateway_address
from kvstrata.v1 import inference_pb2, inference_pb2_grpc


def generate(
    prompt: str, api_key: str = typer.Option(..., envvar="KVSTRATA_API_KEY"),
    max_tokens: int = typer.Option(128, min=1, max=MAX_UINT32),
    temperature: float = typer.Option(0.0, min=0, max=100, callback=finite, help="0: greedy"),
    session: str = "",
    policy: str = typer.Option("", help="KV policy spec for this request (default: the tenant's)"),
    gateway: str | None = None,
) -> None:
    """Stream a chat completion to the terminal."""
    req = inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=prompt)]),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature),
        session_id=session, policy=policy,
    )
    with grpc.insecure_channel(gateway_address(gateway)) as ch:
        try:
            for msg in inference_pb2_grpc.InferenceServiceStub(ch).Generate(
                    req, metadata=(("authorization", f"Bearer {api_key}"),)):
                kind = msg.WhichOneof("event")
                if kind == "delta":
                    print(msg.delta.text, end="", flush=True)
                elif kind == "finished":
                    f = msg.finished
                    print()
                    console.print(f"[dim]{f.finish_reason}: {f.prompt_tokens} prompt tokens "
                                  f"({f.cached_tokens.device} cached), {f.completion_tokens} generated, "
                                  f"TTFT {f.ttft_ms:.0f} ms, TPOT {f.tpot_ms:.0f} ms[/dim]")
        except grpc.RpcError as err:
            fail(err)
