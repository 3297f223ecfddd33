"""``kvstrata generate``: stream one chat completion to the terminal."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Sequence
from typing import TextIO

import grpc
import typer
from rich.markup import escape

from cache_node.sampling_params import (
    MAX_REQUEST_TEMPERATURE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)
from cli.constraints import NO_CONSTRAINTS, Constraints, constraints
from cli.messages import chat, messages_from_text, tool_results
from cli.options import MAX_UINT32, GatewayOpt, finite, id_chars
from cli.options import api_key as api_key_value
from cli.output import CANCELLED_EXIT_CODE, console, fail, say
from cli.state import RPC_TIMEOUT_S, gateway_channel
from cli.tools import apply_tools, tool_call_lines
from kvstrata.v1 import inference_pb2, inference_pb2_grpc
from services.node_request import MAX_PRIORITY, MIN_PRIORITY

FINISH_REASONS = {
    "stop": "the model ended its answer",
    "length": "max_tokens reached (or the model's context length)",
    "abort": "the server aborted the request (a drain or a node failure)",
    "tool_calls": "the model called the tools listed above",
}
"""What each ``GenerateFinished.finish_reason`` means, as ``generate`` prints it."""

STOP_WITH_STOP_STRINGS = "the model ended its answer or a --stop string matched"
"""What ``stop`` means when the request had stop strings: ``GenerateFinished`` says ``stop``
for both and carries nothing that tells them apart."""

def stop_strings(values: list[str] | None) -> list[str]:
    """Typer callback for ``--stop``: at most ``MAX_STOP_STRINGS``, each 1 to
    ``MAX_STOP_STRING_CHARS`` characters (the node's bounds, checked here as a usage error)."""
    values = values or []
    if len(values) > MAX_STOP_STRINGS:
        raise typer.BadParameter(f"at most {MAX_STOP_STRINGS} stop strings, got {len(values)}")
    if any(not 0 < len(v) <= MAX_STOP_STRING_CHARS for v in values):
        raise typer.BadParameter(f"a stop string has 1 to {MAX_STOP_STRING_CHARS} characters")
    return values


def finish_line(finished: inference_pb2.GenerateFinished, stop: Sequence[str] = ()) -> str:
    """The closing line: the finish reason explained, token counts, TTFT and TPOT (ms).

    ``stop`` is the request's stop strings: with any, a ``stop`` finish may be either the
    model's own end or a stop string (the node reports both as ``stop``), and the line says so.
    """
    reason = finished.finish_reason
    why = FINISH_REASONS.get(reason, "an unknown finish reason")
    if reason == "stop" and stop:
        why = STOP_WITH_STOP_STRINGS
    return (f"{reason}: {why}. {finished.prompt_tokens} prompt tokens ({finished.cached_tokens.device} "
            f"cached on the device), {finished.completion_tokens} generated, TTFT {finished.ttft_ms:.0f} ms, "
            f"TPOT {finished.tpot_ms:.0f} ms")


def stream_to(call: Iterable[inference_pb2.GenerateResponse], out: TextIO, stop: Sequence[str] = (),
              hold: bool = False) -> inference_pb2.GenerateFinished | None:
    """Write the deltas of a ``Generate`` stream to ``out``, then the finish line (``stop``: the
    request's stop strings, see ``finish_line``). ``hold`` (a request with tools): the text is
    written at the end, and a reply read as tool calls is written as its content and one line
    per call, as the HTTP API's stream holds a call's text back (trial 30n P7: the call's JSON,
    and with auto its ``<tool_call>`` markup, was streamed, then the call line repeated it).

    Returns the stream's ``GenerateFinished`` (None: the stream ended without one).

    ``call`` is the stub's response iterator (a ``grpc.Call``). On ``KeyboardInterrupt``
    (Ctrl-C) the call is cancelled, so the gateway aborts the request on its node, the
    line of text is ended, a note says the request was cancelled, and the command exits
    with ``CANCELLED_EXIT_CODE``.

    Raises:
        grpc.RpcError: the call failed (not by our cancel).
        typer.Exit: after a cancel (``CANCELLED_EXIT_CODE``), or 1 when the server aborted the
            request (finish reason ``abort``: a drain or a node failure cut the answer off).
    """
    mid_line, held, finished = False, [], None
    try:
        for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "delta" and msg.delta.text:
                if hold:
                    held.append(msg.delta.text)
                    continue
                out.write(msg.delta.text)
                out.flush()
                mid_line = not msg.delta.text.endswith("\n")
            elif kind == "finished":
                finished = msg.finished
                if hold:
                    text = msg.finished.content if msg.finished.tool_calls else "".join(held)
                    out.write(text)
                    mid_line = bool(text) and not text.endswith("\n")
                if mid_line:
                    out.write("\n")
                mid_line = False
                out.writelines(line + "\n" for line in tool_call_lines(msg.finished))  # (--tools)
                out.flush()
                console.print(f"[dim]{finish_line(msg.finished, stop)}[/dim]", soft_wrap=True)
                if msg.finished.finish_reason == "abort":  # cut off by the server: not done
                    raise typer.Exit(1)
    except KeyboardInterrupt:
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            cancel()
        if held:  # (hold: what arrived is still shown)
            out.write("".join(held))
            mid_line = not held[-1].endswith("\n")
        if mid_line:
            out.write("\n")
        out.flush()
        console.print("[yellow]cancelled (Ctrl-C): the request was cancelled; the text above is "
                      "what arrived before[/yellow]", soft_wrap=True)
        raise typer.Exit(CANCELLED_EXIT_CODE) from None
    return finished


def results_hint(session: str, cache_salt: str = "") -> str:
    """The line after a reply's tool calls: how to send their results back (``--tool-result``).
    The session id and salt are shell-quoted, so the command runs as printed (with ``--tools``
    and ``--tool-result`` filled in). Regression (s37 review r3): the session id was not, so one
    with a space or a shell character split or changed the command. It names ``--tool-choice
    none``: without it the tools' default choice is "auto", which a gateway without
    ``tool_call_parser`` (the default config) refuses. Regression (s41 new-user walkthrough):
    the command as printed ended INVALID_ARGUMENT "tool_choice: "auto" ... needs the server's
    tool call parser" on a plain ``kvstrata up``."""
    if session:
        salt = f" --cache-salt {shlex.quote(cache_salt)}" if cache_salt else ""
        return (f"send each result back with: kvstrata generate --session {shlex.quote(session)}{salt} --tools ... "
                "--tool-choice none --tool-result ID=RESULT (ID=@FILE: the file's text; --tool-choice none: the "
                "model answers in text; auto, which lets it call a tool again, needs the server's tool_call_parser)")
    return ("send each result back with --tool-result ID=RESULT and --messages holding the conversation so far "
            "with this reply as an assistant message's tool_calls, with --tools and --tool-choice none (or continue "
            "in a --session)")


def generate_request(prompt: str | inference_pb2.ChatMessages, max_tokens: int, temperature: float, session: str,
                     policy: str, priority: int = 0, stop: list[str] | None = None,
                     constrained: Constraints = NO_CONSTRAINTS, cache_salt: str = "") -> inference_pb2.GenerateRequest:
    """The ``Generate`` request of one ``kvstrata generate`` call: its chat (``prompt``: one
    user message's text, or the messages ``cli.messages.chat`` built), its sampling (``stop``
    in ``SamplingParams.stop``, ``constrained``'s fields), ``GenerateRequest.priority`` and
    ``GenerateRequest.cache_salt``."""
    if isinstance(prompt, str):
        prompt = inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=prompt)])
    req = inference_pb2.GenerateRequest(
        chat=prompt,
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop or []),
        session_id=session, policy=policy, priority=priority, cache_salt=cache_salt,
    )
    constrained.apply(req.sampling)
    return req


def generate(
    prompt: str | None = typer.Argument(None, metavar="PROMPT", show_default=False,
                                        help="the user message (one chat turn); may be left out with "
                                        "--messages or --tool-result"),
    api_key: str = typer.Option(..., envvar="KVSTRATA_API_KEY", callback=api_key_value,
                                help="the tenant's API key (from `kvstrata tenant add`)"),
    max_tokens: int = typer.Option(128, min=1, max=MAX_UINT32,
                                   help="most tokens to generate (finish reason `length` when reached)"),
    temperature: float = typer.Option(0.0, min=0, max=MAX_REQUEST_TEMPERATURE, callback=finite,
                                      help="sampling temperature; 0: greedy (deterministic)"),
    session: str = typer.Option("", callback=id_chars("--session"),
                                help="a session id of your choice: turns of one session reuse the "
                                "previous turns' KV cache (default: no session)"),
    cache_salt: str = typer.Option("", "--cache-salt", metavar="SALT", callback=id_chars("--cache-salt"),
                                   help="partitions your prefix cache further (the HTTP API's `cache_salt`): "
                                   "requests share cached KV only with requests of the same salt, and a "
                                   "--session is one of this salt alone (default: none)"),
    policy: str = typer.Option("", help="KV policy spec for this request, e.g. sentencekv-0.25 "
                               "(default: the tenant's)"),
    priority: int = typer.Option(0, min=MIN_PRIORITY, max=MAX_PRIORITY,
                                 help="lower is served earlier, among your own waiting requests only "
                                 "(never ahead of another tenant's)"),
    stop: list[str] | None = typer.Option(None, "--stop", metavar="TEXT", callback=stop_strings,
                                          help=f"end the answer before this text (repeat, up to "
                                          f"{MAX_STOP_STRINGS}; finish reason `stop`)"),
    json_object: bool = typer.Option(False, "--json", help="answer with a JSON object (structured output)"),
    json_schema: str | None = typer.Option(None, "--json-schema", metavar="SCHEMA",
                                           help="answer with JSON matching this schema (its text, or @FILE)"),
    regex: str | None = typer.Option(None, metavar="REGEX", help="answer with text matching this regex"),
    choice: list[str] | None = typer.Option(None, "--choice", metavar="TEXT",
                                            help="answer with exactly one of these (repeat, up to 256)"),
    grammar: str | None = typer.Option(None, metavar="EBNF",
                                       help="answer in this EBNF grammar with a root rule (its text, or @FILE)"),
    logit_bias: list[str] | None = typer.Option(None, "--logit-bias", metavar="ID=BIAS",
                                                help="add BIAS in [-100, 100] to token ID's logit (repeat)"),
    allowed_token_ids: list[int] | None = typer.Option(None, "--allowed-token-id", metavar="ID",
                                                       help="only these token ids may be generated (repeat)"),
    tools: str | None = typer.Option(None, "--tools", metavar="JSON",
                                     help="tools the model may call: a JSON list in OpenAI's shape "
                                     "([{\"type\": \"function\", \"function\": {\"name\", \"parameters\"}}]; its "
                                     "text, or @FILE)"),
    tool_choice: str | None = typer.Option(None, "--tool-choice", metavar="CHOICE",
                                           help="none, auto (the default with --tools; needs the server's tool "
                                           "call parser), required, or a function name of --tools"),
    messages: str | None = typer.Option(None, "--messages", metavar="JSON",
                                        help="the conversation so far, sent before the tool results and PROMPT: "
                                        "an OpenAI messages list ([{\"role\", \"content\", \"tool_calls\"?, "
                                        "\"tool_call_id\"?}]; its text, or @FILE)"),
    tool_result: list[str] | None = typer.Option(None, "--tool-result", metavar="ID=TEXT",
                                                 help="a tool call's result, sent as a tool message answering "
                                                 "call ID (a `tool call ID:` line's id; ID=@FILE: the file's "
                                                 "text); repeat for each call; with --session or --messages"),
    gateway: str | None = GatewayOpt,
) -> None:
    """Stream a chat completion to the terminal; the last line says why it ended and how fast it was.

    One structured output at most (`--json`, `--json-schema`, `--regex`, `--choice`, `--grammar`);
    the node compiles it (a schema or regex it cannot compile is refused, naming it).

    Greedy by default (`--temperature 0`; the HTTP API's default is OpenAI's 1). Finish reasons:
    `stop` (the model ended its answer, or a `--stop` string matched: the server reports both as
    `stop`, so with --stop the line names both), `length` (max_tokens reached), `abort` (the
    server aborted it), `tool_calls` (with --tools: the reply was read as tool calls, one line
    each, `tool call ID: NAME(ARGUMENTS)`). Ctrl-C cancels the request (exit code 130).

    To complete a tool call, send its result back: in a `--session`, whose node keeps the
    reply's calls, `--session S --tools ... --tool-result ID=RESULT` (no PROMPT needed);
    without one, `--tool-result` with `--messages` holding the conversation so far, the
    assistant message with its `tool_calls` included. The messages sent are `--messages`',
    then one tool message per `--tool-result`, then PROMPT as a user message.

    With `--cache-salt` the request shares cached KV only with requests of the same salt (as
    the HTTP API's `cache_salt`), and a `--session` is the session of that salt: its turns, and
    `kvstrata close-session --cache-salt`, name the same salt.
    """
    constrained = constraints(json_object, json_schema, regex, choice, grammar, logit_bias, allowed_token_ids)
    sent, sources = chat(prompt, [] if messages is None else messages_from_text(messages),
                         tool_results(tool_result or []), session)
    req = generate_request(sent, max_tokens, temperature, session, policy, priority, stop, constrained, cache_salt)
    apply_tools(req, tools, tool_choice)
    with gateway_channel(gateway) as ch:
        try:
            finished = stream_to(inference_pb2_grpc.InferenceServiceStub(ch).Generate(
                req, metadata=(("authorization", f"Bearer {api_key}"),)), sys.stdout, stop or (), hold=bool(req.tools))
        except grpc.RpcError as err:
            fail(err, lambda line: sources.reword(line)[0])
    if finished is not None and finished.tool_calls:
        console.print(f"[dim]{escape(results_hint(session, cache_salt))}[/dim]", soft_wrap=True)


def close_session(
    session: str = typer.Argument(..., metavar="SESSION", callback=id_chars("SESSION"),
                                  help="the session id given to `generate --session`"),
    api_key: str = typer.Option(..., envvar="KVSTRATA_API_KEY", callback=api_key_value,
                                help="the tenant's API key (the session's own tenant)"),
    cache_salt: str = typer.Option("", "--cache-salt", metavar="SALT", callback=id_chars("--cache-salt"),
                                   help="the cache_salt the session's turns were sent with (the HTTP API's "
                                   "`cache_salt`; default: none): under another salt, or none, the same "
                                   "SESSION is another session"),
    gateway: str | None = GatewayOpt,
) -> None:
    """Close one of your sessions: its KV is freed now, not when it expires (the server's
    `session_ttl_s` after its last turn); prints the tokens of history freed. Exit 1 with
    NOT_FOUND when you have no session by that id under that `--cache-salt`.

    A session is one (SESSION, cache_salt) of its tenant: one opened through the HTTP API with
    a `cache_salt` is closed with `--cache-salt` naming it (as `DELETE
    /v1/sessions/{id}?cache_salt=` does); without it the unsalted session of that id is
    closed, never a salted one."""
    with gateway_channel(gateway) as ch:
        try:
            resp = inference_pb2_grpc.InferenceServiceStub(ch).CloseSession(
                inference_pb2.CloseSessionRequest(session_id=session, cache_salt=cache_salt),
                metadata=(("authorization", f"Bearer {api_key}"),), timeout=RPC_TIMEOUT_S)
        except grpc.RpcError as err:
            fail(err)
    under = f" (cache_salt {escape(cache_salt)!r})" if cache_salt else ""
    say(f"closed session {escape(session)}{under}: {resp.freed_tokens} tokens of history freed")
