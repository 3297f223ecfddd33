"""A compiled grammar a compiler process sends is untrusted up to its first matcher (review 28a
F1): one that loads (``CompiledGrammar.deserialize_json``) but cannot make a ``GrammarMatcher``
is refused on the compile thread (``Grammars._probe``: "could not be loaded", its process
replaced, nothing cached); should a matcher still fail on the step thread
(``GrammarState.poll``) or a request's poll raise anything (``LLMEngine._poll_grammars``), that
request alone ends, never the node's step loop.

Regression: ``GrammarState.poll`` built the matcher with no guard, from ``_poll_grammars`` at the
start of ``LLMEngine.step`` outside its recovery: the child's reply with its ``"optimized"`` flag
cleared (a loadable grammar whose matcher raises "The grammar is not optimized") ended the
node's step loop, every tenant's streams UNAVAILABLE and the node unhealthy.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Any

import pytest

from cache_node.grammar_process import CompilerProcess
from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from tests.conftest import make_grammars

TAMPER_CHILD = """
import cache_node.grammar_worker as w
_frame = w.frame
def frame(message):
    if message and message[0] == "ok":
        assert '"optimized":true' in message[1]
        message = ["ok", message[1].replace('"optimized":true', '"optimized":false')]
    return _frame(message)
w.frame = frame
w.main()
"""
"""The real compiler child, each "ok" reply's grammar JSON with ``"optimized": false``."""

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)
GOOD_TOKENS = 300
"""What the unconstrained request decodes while the bad grammar reaches the node: evil ended
~0.15 s after its compile was let go, good's 300 tokens take seconds (1,500 took ~68 s of a
~100-s test on the loaded 2-core host, with evil long done)."""


class _TamperedProcess(CompilerProcess):
    """A compiler process running ``TAMPER_CHILD``; its compiles wait on ``gate``."""

    gate = threading.Event()

    def __init__(self, tokenizer_info_json: str, memory_bytes: int) -> None:
        super().__init__(tokenizer_info_json, memory_bytes, argv=(sys.executable, "-c", TAMPER_CHILD))

    def compile(self, method: str, text: str, timeout_s: float) -> tuple[bool, str]:
        self.gate.wait(120)
        return super().compile(method, text, timeout_s)


@pytest.fixture
def tampered(monkeypatch: pytest.MonkeyPatch) -> type[_TamperedProcess]:
    pytest.importorskip("xgrammar")
    import cache_node.grammars

    monkeypatch.setattr(cache_node.grammars, "CompilerProcess", _TamperedProcess)
    _TamperedProcess.gate = threading.Event()
    return _TamperedProcess


def test_a_loadable_grammar_that_makes_no_matcher_is_refused_on_the_compile_thread(tampered, grammar_tokenizer) -> None:
    """The tampered grammar is refused "could not be loaded", not cached, its process replaced."""
    g = make_grammars(grammar_tokenizer, workers=1)
    tampered.gate.set()
    try:
        spec = StructuredOutputSpec("regex", "[a-c]{3}")
        exc = g.compile(spec, "evil").exception(timeout=120)
        assert str(exc) == "structured_output: the compiled grammar could not be loaded"
        assert g.num_compiled == 0 and len(g._cache) == 0
        deadline = time.monotonic() + 120
        while not g.processes[0].ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g.processes[0].num_starts == 2  # killed and started again
        again = g.compile(spec, "evil").exception(timeout=120)  # compiled again: the node's failure, not remembered
        assert str(again) == str(exc) and g.num_compiled == 0 and len(g._cache) == 0
    finally:
        g.close()


LEAN_SPECS = (
    ("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                 "age": {"type": "integer", "minimum": 0}},
                                "required": ["name", "age"]})),
    ("json_schema", json.dumps({"type": "object"})),
    ("regex", "20[0-9]{2}-[01][0-9]-[0-3][0-9]"),
    ("grammar", 'root ::= "yes" | "no" | [a-c]+'),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"],
        "tags": [{"begin": '<tool_call>{"name": "f", "arguments": ', "end": "}</tool_call>",
                  "content": {"type": "json_schema", "json_schema": {
                      "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]}})),
)
"""One spec of each compile method (``grammar_worker.METHODS``)."""


def test_the_child_compiles_what_xgrammar_compiles_without_importing_torch_or_transformers(grammar_tokenizer) -> None:
    """The child imports only xgrammar's compiler (``grammar_worker.import_compiler``): each of
    ``LEAN_SPECS`` (every method) compiles there to the very bytes the node's own ``import
    xgrammar`` compiles, a spec that does not compile is refused with the same message, and
    the process maps no torch library and holds under 160 MiB resident (~290 MiB with torch)."""
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(grammar_tokenizer, vocab_size=49152, stop_token_ids=[2])
    here = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    from cache_node.grammar_worker import _compile

    process = CompilerProcess(info.serialize_json(), 1 << 30)
    try:
        process.start()
        for method, text in LEAN_SPECS:
            assert process.compile(method, text, 60) == (True, _compile(here, method, text).serialize_json()), method
        ok, message = process.compile("regex", "(abc", 60)
        assert not ok and message == "Regex parsing error at position 5: The parenthesis is not closed."
        with open(f"/proc/{process.pid}/maps") as f:
            maps = f.read()
        assert "libxgrammar_bindings" in maps and "libtorch" not in maps
        with open(f"/proc/{process.pid}/status") as f:
            rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        assert rss_kib < 160 << 10, rss_kib
    finally:
        process.kill()


def _request(rid: str, tenant: str, max_tokens: int, structured: StructuredOutputSpec | None = None) -> Any:
    from services.node_request import NodeRequest

    return NodeRequest(request_id=f"{tenant}/{rid}", tenant=tenant, cache_namespace=f"tenant:{tenant}",
                       token_ids=PROMPT, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=structured is None,
                                                                 structured_output=structured))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["probe", "matcher", "poll"])
def test_a_bad_compiled_grammar_refuses_its_request_alone(tampered, monkeypatch: pytest.MonkeyPatch,
                                                          stage: str) -> None:
    """A ``CacheNode`` (the tiny Llama, SmolLM2's tokenizer) whose compiler child sends the tampered
    grammar. Tenant "good" streams ``GOOD_TOKENS`` unconstrained tokens; meanwhile tenant "evil"'s regex
    request gets the grammar and ends with an error naming structured_output (``probe``: refused
    at the compile, UNAVAILABLE, the node's fault as every compile failure that is not the
    spec's; ``matcher``: the probe skipped, so the matcher fails in ``GrammarState.poll``,
    INTERNAL; ``poll``: the poll itself raises, INTERNAL). Good
    finishes "length" after evil's error, and the node stays healthy."""
    from bench.chaos_stack import tiny_checkpoint
    from cache_node.grammar_mask import GrammarState
    from cache_node.grammars import Grammars
    from services.cache_node import CacheNode
    from services.config import NodeConfig

    if stage != "probe":
        monkeypatch.setattr(Grammars, "_probe", lambda self, compiled: None)
    if stage == "poll":
        poll = GrammarState.poll

        def raising(self: GrammarState) -> bool:
            if self.future.done():
                raise RuntimeError("a poll that fails")
            return poll(self)

        monkeypatch.setattr(GrammarState, "poll", raising)

    node = CacheNode("n0", NodeConfig(model_path=str(tiny_checkpoint()), kv_pool_bytes=4 << 20, host_bytes=0,
                                      grammar_compile_workers=1), num_threads=1)

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        evil = node.generate(_request("r1", "evil", 8, StructuredOutputSpec("regex", "[a-c]{3}")))
        order: list[str] = []
        evil_events: list[dict[str, Any]] = []

        async def drain_evil() -> None:
            async for event in evil:
                evil_events.append(event)
            order.append("evil")

        evil_task = asyncio.ensure_future(drain_evil())
        deadline = time.monotonic() + 180  # the child's import
        grammars = node.engine.grammars
        while not (grammars.processes[0] is not None and grammars.processes[0].ready):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        good = node.generate(_request("r2", "good", GOOD_TOKENS))
        good_events = [await asyncio.wait_for(good.__anext__(), 60)]
        assert good_events[0]["type"] not in ("error", "finished"), good_events
        tampered.gate.set()  # evil's compile runs while good decodes
        async for event in good:
            good_events.append(event)
        order.append("good")
        await asyncio.wait_for(evil_task, 60)
        assert order == ["evil", "good"]  # good was still decoding when evil ended
        return evil_events, good_events

    try:
        evil_events, good_events = asyncio.run(run())
        assert [e["type"] for e in evil_events] == ["error"], evil_events
        code, message = evil_events[0]["code"], evil_events[0]["message"]
        if stage == "poll":
            assert code == "INTERNAL"
            assert node.engine.num_failed_requests == 1
        else:
            assert code == ("UNAVAILABLE" if stage == "probe" else "INTERNAL")
            assert message == ("structured_output: the compiled grammar could not be loaded" if stage == "probe" else
                               "structured_output: the compiled grammar could not be used (see the cache node's log)")
        assert good_events[-1]["type"] == "finished" and good_events[-1]["finish_reason"] == "length"
        assert sum(len(e.get("token_ids", ())) for e in good_events) == GOOD_TOKENS
        assert node.ping() and not node.failure
        assert not node.engine.requests and not node.engine._compiling
    finally:
        node.shutdown()
