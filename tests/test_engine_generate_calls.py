"""``LLMEngine.generate`` on a tiny random Llama: a call returns its own requests' outputs, one
call steps an engine at a time, and a failed call leaves none of its requests running."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cache_node.outputs import InvalidRequestError
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def test_a_call_that_fails_leaves_none_of_its_requests_in_the_engine(tiny) -> None:
    """Regression (s40): a call whose second prompt was refused left its first request running
    in the engine, unseen (and the next call's steps counted that request's end as theirs: a
    KeyError when it came first). Now the call aborts what it added, and the next call returns
    its own output."""
    eng = make_engine(tiny)
    with pytest.raises(InvalidRequestError):
        eng.generate([prompt_of(10), prompt_of(eng.max_model_len + 1)], PARAMS)
    assert eng.requests == {}
    [out] = eng.generate([prompt_of(12, 3)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert (out.finish_reason, len(out.output_token_ids), out.num_prompt_tokens) == ("length", 3, 12)
    assert eng.requests == {} and not eng.has_unfinished_requests()
    eng.check_integrity()


def test_a_second_call_while_one_steps_the_engine_is_refused(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (s40): two calls on one engine (two threads) each took every finished output
    of its steps as its own: the second returned with the first's request finished in its steps,
    and the first then waited for ever for its output. Now the second is refused while the first
    steps (held in its first step here), and the first returns its own output."""
    eng = make_engine(tiny)
    step, entered, released = eng.step, threading.Event(), threading.Event()
    first: list[Any] = []

    def held_step(*args: Any) -> Any:
        if threading.current_thread().name == "first-call" and not entered.is_set():
            entered.set()
            released.wait(30)
        return step(*args)

    monkeypatch.setattr(eng, "step", held_step)
    caller = threading.Thread(target=lambda: first.extend(eng.generate([prompt_of(10)], PARAMS)),
                              name="first-call", daemon=True)
    caller.start()
    assert entered.wait(30)
    try:
        with pytest.raises(RuntimeError, match="another generate call steps this engine"):
            eng.generate([prompt_of(10, 5)], PARAMS)
    finally:
        released.set()
    caller.join(30)
    assert not caller.is_alive(), "the first call never returned"
    assert [(o.finish_reason, len(o.output_token_ids), o.num_prompt_tokens) for o in first] == [("length", 4, 10)]
    assert eng.requests == {}
    eng.check_integrity()
