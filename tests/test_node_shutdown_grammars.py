"""A cache node's shutdown ends its grammar compiler processes at once, and an engine dropped
without a shutdown lets them go when it is collected.

``CacheNode.shutdown`` stopped the step thread and closed the data plane, but left the engine's
compiler processes (~290 MB each: xgrammar imports torch) to the engine's finalizer, which runs
only once the node is collected: a node that stays referenced (a caller, a cycle not yet
collected) kept them for good. A full test run held 33 of them (~10 GB) at its end; a process
that rebuilds its node would too. Now shutdown closes the engine's structured outputs once the
step thread has stopped (it alone uses them).

Second: an engine no longer referenced was never collected once it had compiled a grammar.
Each compile thread kept its last job bound while waiting for the next; the job's futures keep
their done callbacks (the engine's bound ``_ready``), so the engine and its ``Grammars`` lived
on and the finalizer that ends the processes never ran (16 processes after
test_structured_output_engine's 9 tests, ``gc.collect()`` or not).
"""

from __future__ import annotations

import gc
import weakref

from bench.chaos_stack import BLOCK_SIZE, POOL_BLOCKS, block_bytes, tiny_checkpoint
from cache_node.model_loader import load_model
from cache_node.sampling_params import SamplingParams
from cache_node.structured_output import StructuredOutputSpec
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest
from tests.test_grammar_compile_limits import _alive, _gone_within
from tests.test_session_stop_cut import run
from tests.test_structured_output_engine import _engine, _run, _spec


def test_shutdown_ends_the_compiler_processes_of_a_node_still_referenced() -> None:
    config = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE,
                        kv_pool_bytes=POOL_BLOCKS * block_bytes(), host_bytes=0, max_num_seqs=2)
    node = CacheNode("n0", config, num_threads=1)
    try:
        req = NodeRequest(request_id="r", tenant="t", cache_namespace="ns", token_ids=(1, 2, 3),
                          sampling=SamplingParams(max_tokens=4, structured_output=StructuredOutputSpec("regex", "[ab]+")))
        _, finished = run(node, req)
        assert finished["finish_reason"] in ("stop", "length"), finished
        pids = [p.pid for p in node.engine.grammars.processes if p is not None and p.pid is not None]
        assert pids and all(_alive(p) for p in pids)
    finally:
        node.shutdown()
    assert _gone_within(pids, 5.0), [p for p in pids if _alive(p)]  # ``node`` is still referenced here
    assert node.engine.grammars is None


def test_an_engine_dropped_after_a_compile_is_collected_and_its_processes_end() -> None:
    eng = _engine(load_model(str(tiny_checkpoint())))  # the tiny Llama with SmolLM2's tokenizer
    [out] = _run(eng, [[1, 2, 3]], [SamplingParams(max_tokens=4, structured_output=_spec("regex", "[ab]+"))]).values()
    assert out.finish_reason in ("stop", "length"), out
    pids = [p.pid for p in eng.grammars.processes if p is not None and p.pid is not None]
    assert pids and all(_alive(p) for p in pids)
    dropped = weakref.ref(eng)
    del eng, out
    gc.collect()
    collected = dropped() is None  # (a failed assert on the engine itself would print its whole repr)
    assert collected, "the engine is still referenced"
    assert _gone_within(pids, 5.0), [p for p in pids if _alive(p)]
