"""A grammar compiler that cannot start refuses its requests; it never strands them.

``Grammars._warm`` (each compile thread's first act) and ``_restart`` caught only
``CompilerDied``: any other exception ended the compile thread, and every structured request
after it waited for its grammar forever (its slot and blocks held, no event). Seen with an
engine whose tokenizer xgrammar cannot read (``ValueError`` from ``TokenizerInfo``: both threads
gone, the request unfinished after 120 s); a ``fork`` failing (``Popen``: EAGAIN under a pid
limit, ENOMEM, EMFILE) ends it the same way. Now the start's failure is logged and left to the
compile, which refuses the request naming ``structured_output``.
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any

import pytest

from cache_node import grammar_process
from cache_node.model_loader import load_model, tiny_llama
from cache_node.sampling_params import SamplingParams
from tests.test_structured_output_engine import _engine, _spec

REGEX = SamplingParams(max_tokens=4, structured_output=_spec("regex", "[ab]+"))


def _finish_within(eng: Any, seconds: float) -> Any:
    rid = eng.add_request([1, 2, 3], REGEX)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out
        time.sleep(0.01)
    pytest.fail(f"the structured request is still waiting after {seconds} s; "
                f"threads: {[t.name for t in threading.enumerate()]}")


@pytest.mark.parametrize("err", [errno.EAGAIN, errno.ENOMEM, errno.EMFILE])
def test_a_compiler_that_cannot_fork_refuses_the_request(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    from bench.chaos_stack import tiny_checkpoint

    def no_fork(*args: Any, **kwargs: Any) -> Any:
        raise OSError(err, "fork refused (test)")

    monkeypatch.setattr(grammar_process.subprocess, "Popen", no_fork)
    eng = _engine(load_model(str(tiny_checkpoint())))
    try:
        out = _finish_within(eng, 30.0)
        assert out.finish_reason == "rejected", out
        assert "structured_output" in (out.error or ""), out
        assert not eng.check_integrity()
    finally:
        eng.close_structured_output()


def test_a_tokenizer_xgrammar_cannot_read_refuses_the_request() -> None:
    eng = _engine(tiny_llama(seed=0))  # its tokenizer is None: TokenizerInfo raises ValueError
    try:
        out = _finish_within(eng, 30.0)
        assert out.finish_reason == "rejected", out
        assert not eng.check_integrity()
    finally:
        eng.close_structured_output()
