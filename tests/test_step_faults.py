"""A step that raises fails the request it belongs to, not the node (``LLMEngine._recover``).

Regression: a KV policy's exception inside ``engine.step`` (its ``begin_step``, ``attend`` or
``after_step``) escaped the step, stopped the cache node's step loop, and every tenant's
requests on that node failed with it. Now the request whose policy raised finishes with
"error" (INTERNAL on the wire), the rest of the batch recomputes its half-written step and
produces exactly the tokens it produces alone, and every block goes back.
"""

from __future__ import annotations

import pytest
import torch

from cache_node.engine import LLMEngine
from cache_node.engine_recovery import MAX_FAILED_STEPS
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine, node_metric

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
SPECS = {"plain": "", "h2o": "h2o-40", "snapkv": "snapkv-40"}


def prompt_of(n: int, offset: int) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


PROMPTS = {"plain": prompt_of(50, 0), "h2o": prompt_of(60, 1), "snapkv": prompt_of(70, 2)}


def engine(tiny) -> LLMEngine:
    return make_engine(tiny, max_num_batched_tokens=256)


def alone(tiny, name: str) -> list[int]:
    return list(engine(tiny).generate([PROMPTS[name]], PARAMS, policy=SPECS[name])[0].output_token_ids)


def run(eng: LLMEngine) -> dict[str, object]:
    """Step until every request finished; the final output per request id."""
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def boom(*_args, **_kw):  # type: ignore[no-untyped-def]
    raise RuntimeError("a policy bug")


def fail_call(eng: LLMEngine, monkeypatch, k: int | None, message: str, poisoned: tuple[str, ...] = ()) -> list[int]:
    """Make the runner's ``execute`` raise ``message``, naming no request: its ``k``-th call
    (1-based), and every step of a request in ``poisoned`` once it has output tokens.
    Returns the batch sizes of every call, the failed ones included."""
    execute, sizes = eng.runner.execute, []

    def failing(batch, *a, **kw):  # type: ignore[no-untyped-def]
        sizes.append(len(batch))
        if len(sizes) == k or any(seq.request_id in poisoned and seq.output_token_ids for seq, _ in batch):
            raise RuntimeError(message)
        return execute(batch, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", failing)
    return sizes


@pytest.mark.parametrize("stage", ["attend", "begin_step", "after_step"])
def test_a_policy_fault_fails_its_request_alone(tiny, stage: str) -> None:
    eng = engine(tiny)
    ids = {name: eng.add_request(PROMPTS[name], PARAMS, request_id=name, policy=SPECS[name]) for name in SPECS}
    setattr(eng.requests[ids["h2o"]].kv, stage, boom)  # the instance's method raises
    final = run(eng)
    assert final["h2o"].finish_reason == "error" and final["h2o"].output_token_ids == ()
    for name in ("plain", "snapkv"):  # recomputed where the step was half written: same tokens
        assert final[name].finish_reason == "length"
        assert list(final[name].output_token_ids) == alone(tiny, name), name
        assert final[name].num_preemptions == (0 if stage == "after_step" else 1)
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0 and not eng.requests
    assert eng.num_failed_requests == 1 and node_metric(eng, "kvstrata:num_requests_failed_total") == 1
    # the node goes on serving
    assert eng.generate([PROMPTS["h2o"]], PARAMS, policy=SPECS["h2o"])[0].finish_reason == "length"


def test_a_failed_session_turn_keeps_the_earlier_history(tiny) -> None:
    eng = engine(tiny)
    first = eng.generate([PROMPTS["h2o"]], PARAMS, session_id="s", tenant="a", policy="h2o-40")[0]
    history = eng.session_history("s")
    assert history == PROMPTS["h2o"] + list(first.output_token_ids)
    rid = eng.add_request(history + [5, 6, 7], PARAMS, session_id="s", tenant="a", policy="h2o-40")
    eng.requests[rid].kv.attend = boom
    assert run(eng)[rid].finish_reason == "error"
    assert eng.session_history("s") == history  # the failed turn is not part of it
    again = eng.generate([history + [5, 6, 7]], PARAMS, session_id="s", tenant="a", policy="h2o-40")[0]
    assert again.finish_reason == "length"
    eng.close_session("s")
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0


def test_a_fault_naming_no_request_is_told_apart_and_fails_its_request_alone(tiny, monkeypatch) -> None:
    """An exception that names no request (the model runner itself) is told apart: the batch
    is preempted and each of its sequences runs alone until past that step; the one whose
    step fails alone finishes with "error", the others produce exactly their tokens alone.

    Regression: such an exception failed the whole batch, so one tenant's request that broke
    the forward pass failed every other tenant's request stepping with it."""
    eng = engine(tiny)
    sizes = fail_call(eng, monkeypatch, None, "CUDA error: an illegal memory access was encountered", ("h2o",))
    for name, spec in SPECS.items():
        eng.add_request(PROMPTS[name], PARAMS, request_id=name, policy=spec)
    final = run(eng)
    assert final["h2o"].finish_reason == "error"
    for name in ("plain", "snapkv"):
        assert final[name].finish_reason == "length"
        assert list(final[name].output_token_ids) == alone(tiny, name), name
    assert 1 in sizes and max(sizes[sizes.index(1):]) > 1  # a step alone, then batches again
    assert eng.stats()["used_blocks"] == 0 and eng.num_failed_requests == 1


def test_two_requests_breaking_the_forward_pass_fail_alone_and_the_node_serves_on(tiny, monkeypatch) -> None:
    """A review: the steps run alone to tell a failed batch apart counted towards
    ``MAX_FAILED_STEPS``, so two such requests in one batch (a batch failure, then each
    alone) re-raised and brought the node down with every other tenant's requests. A step
    run alone does not count: both fail, the third request decodes as alone."""
    eng = engine(tiny)
    fail_call(eng, monkeypatch, None, "CUDA error: an illegal memory access was encountered", ("h2o", "snapkv"))
    for name, spec in SPECS.items():
        eng.add_request(PROMPTS[name], PARAMS, request_id=name, policy=spec)
    final = run(eng)
    assert final["h2o"].finish_reason == final["snapkv"].finish_reason == "error"
    assert final["plain"].finish_reason == "length"
    assert list(final["plain"].output_token_ids) == alone(tiny, "plain")
    assert eng.stats()["used_blocks"] == 0


def test_after_a_fault_the_batch_recomputes_together_and_only_the_failed_step_runs_alone(tiny, monkeypatch) -> None:
    """A review: each sequence of a failed batch recomputed alone, one after another (under a
    compressing policy one output token per step), so one transient fault froze the node for
    hundreds of steps (a request arriving after it waited 271 steps for its first token).
    Now they recompute up to the failed step in batches, and only that step runs alone."""
    eng = make_engine(tiny, max_num_batched_tokens=512)
    sizes = fail_call(eng, monkeypatch, 12, "CUDA error: out of memory")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [prompt_of(40, k) for k in range(4)]
    for k, prompt in enumerate(prompts):
        eng.add_request(prompt, params, request_id=f"r{k}", policy="h2o-20")
    final, late_first = {}, None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "late" and out.new_token_ids and late_first is None:
                late_first = len(sizes)
            if out.finished:
                final[out.request_id] = out
        if len(sizes) == 12:  # the fault: a request arrives right after it
            eng.add_request(prompt_of(20, 9), SamplingParams(max_tokens=2, ignore_eos=True), request_id="late")
    ref = make_engine(tiny, max_num_batched_tokens=512).generate(prompts, params, policy="h2o-20")
    assert [list(final[f"r{k}"].output_token_ids) for k in range(4)] == [list(o.output_token_ids) for o in ref]
    assert sizes[12:].count(1) <= 4 + 2  # one step alone per sequence of the failed batch (+ late's)
    assert late_first is not None and late_first - 12 <= 20, late_first


def test_a_passing_fault_naming_no_request_fails_nothing(tiny, monkeypatch) -> None:
    eng = engine(tiny)
    fail_call(eng, monkeypatch, 3, "CUDA error: an illegal memory access was encountered")
    for name, spec in SPECS.items():
        eng.add_request(PROMPTS[name], PARAMS, request_id=name, policy=spec)
    final = run(eng)
    for name in SPECS:
        assert final[name].finish_reason == "length"
        assert list(final[name].output_token_ids) == alone(tiny, name), name
    assert eng.stats()["used_blocks"] == 0 and eng.num_failed_requests == 0


def test_a_broken_runner_fails_requests_then_the_node(tiny, monkeypatch) -> None:
    """``MAX_FAILED_STEPS`` failed steps in a row re-raise (a broken node restarts instead of
    failing every request forever); a success in between starts the count again."""
    eng = engine(tiny)
    monkeypatch.setattr(eng.runner, "execute", boom)
    for i in range(MAX_FAILED_STEPS - 1):  # alone: each failed step is its request's
        eng.add_request(PROMPTS["plain"], PARAMS, request_id=f"r{i}")
        assert run(eng)[f"r{i}"].finish_reason == "error"
    eng.add_request(PROMPTS["plain"], PARAMS, request_id="last")
    with pytest.raises(RuntimeError, match="a policy bug"):
        eng.step()

    eng = engine(tiny)
    execute, calls = eng.runner.execute, []

    def every_other(batch, *a, **kw):  # type: ignore[no-untyped-def]
        calls.append(len(batch))
        if len(calls) % 2:
            raise RuntimeError("flaky")
        return execute(batch, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", every_other)
    eng.add_request(PROMPTS["plain"], PARAMS, request_id="p")
    assert run(eng)["p"].finish_reason == "error"  # alone: its first failed step is its own
    eng.add_request(PROMPTS["plain"], PARAMS, request_id="q")
    eng.add_request(PROMPTS["snapkv"], PARAMS, request_id="s")
    assert {out.finish_reason for out in run(eng).values()} <= {"length", "error"}


def test_poison_requests_one_after_another_on_an_idle_node_fail_alone(tiny, monkeypatch) -> None:
    """Regression: on an otherwise idle node, ``MAX_FAILED_STEPS`` requests in a row that
    broke the forward pass (each alone in its step) re-raised, so one tenant could restart
    the node and lose every other tenant's sessions on it. A canary step after such a
    failure tells the request from a broken runner (``LLMEngine._runner_works``)."""
    eng = engine(tiny)
    poisoned = tuple(f"bad{i}" for i in range(MAX_FAILED_STEPS + 1))
    sizes = fail_call(eng, monkeypatch, None, "CUDA error: misaligned address", poisoned)
    for rid in poisoned:
        eng.add_request(PROMPTS["plain"], PARAMS, request_id=rid)
        assert run(eng)[rid].finish_reason == "error"
    assert sizes.count(1) == len(sizes)  # alone in every step, canaries included
    eng.add_request(PROMPTS["plain"], PARAMS, request_id="good")
    out = run(eng)["good"]
    assert out.finish_reason == "length" and list(out.output_token_ids) == alone(tiny, "plain")
    assert eng.num_failed_requests == len(poisoned) and eng.stats()["used_blocks"] == 0
    eng.check_integrity()


DOC = prompt_of(96, 3)
QUESTIONS = [prompt_of(9, 10 + k) for k in range(3)]


def prefix_run(eng: LLMEngine, first: int = 0) -> tuple[list[str], dict[str, object]]:
    ids = [eng.add_request(DOC + q, PARAMS, request_id=f"q{k}", policy="snapkv-40", prefix_tokens=len(DOC))
           for k, q in enumerate(QUESTIONS) if k >= first]
    return ids, run(eng)


def test_a_prefix_producers_fault_hands_the_prefix_on(tiny) -> None:
    """Regression: when the request computing a compressed prefix failed in its compression,
    the requests parked on that prefix were neither forked nor scheduled: they waited
    forever. Now the producer fails alone and the next parked request computes the prefix;
    their answers equal a fault-free run without the failed request (the same batches)."""
    ids, want = prefix_run(engine(tiny), first=1)
    eng = engine(tiny)
    add = eng.add_request

    def faulty_first(*args, **kw):  # type: ignore[no-untyped-def]
        rid = add(*args, **kw)
        if rid == "q0":
            eng.requests[rid].kv.policy.compress = boom
        return rid

    eng.add_request = faulty_first  # type: ignore[method-assign]
    _, got = prefix_run(eng)
    assert got["q0"].finish_reason == "error"
    assert [got[i].output_token_ids for i in ids] == [want[i].output_token_ids for i in ids]
    assert eng.stats()["compressed_prefix_stores"] == 1 and eng.stats()["compressed_prefix_parked"] == 0
    eng.prefixes.clear()
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0


def test_a_policy_that_cannot_fork_computes_each_prefix_itself(tiny, monkeypatch) -> None:
    """A policy whose ``fork`` raises neither stores nor forks a prefix: each request computes
    the prefix itself and runs to its end; nothing is held. (Its tokens are not compared:
    other batches than a forking run's, and the tiny random model's near-ties flip.)"""
    from cache_node.kv_state import SequenceKV

    monkeypatch.setattr(SequenceKV, "fork", boom)
    eng = engine(tiny)
    ids, got = prefix_run(eng)
    assert [(got[i].finish_reason, got[i].num_output_tokens) for i in ids] == [("length", 8)] * 3
    s = eng.stats()
    assert (s["compressed_prefix_stores"], s["compressed_prefix_hits"], s["compressed_prefixes"]) == (0, 0, 0)
    eng.check_integrity()
    assert s["used_blocks"] == 0


def test_a_sampling_fault_fails_its_request_alone(tiny) -> None:
    """A sampled row whose draw raises (here a broken generator; on a device, non-finite
    logits) fails that request alone; a greedy request in the same batch goes on."""
    eng = engine(tiny)
    eng.add_request(PROMPTS["plain"], PARAMS, request_id="plain")
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1)
    eng.add_request(PROMPTS["snapkv"], sampled, request_id="sampled")
    eng.requests["sampled"].generator = "not a generator"
    final = run(eng)
    assert final["sampled"].finish_reason == "error"
    assert list(final["plain"].output_token_ids) == alone(tiny, "plain")
    assert eng.stats()["used_blocks"] == 0


class _FailsAtDraw:
    """A generator whose ``at``-th draw raises (a row whose draw fails mid-stream)."""

    def __init__(self, at: int) -> None:
        self.gen, self.at, self.draws = torch.Generator().manual_seed(7), at, 0

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.gen, name)


@pytest.mark.parametrize("fail_at", [0, 3])
def test_a_sampling_fault_does_not_shift_another_requests_seeded_stream(tiny, monkeypatch, fail_at: int) -> None:
    """Regression (review 23c, G2): a request whose draw failed raised out of the step after
    the rows before it had drawn; the others were preempted and drew that position again from
    their advanced generators: tenant A's seeded stream lost a token and every later one
    shifted, unmarked. Now the failed row alone fails and the others keep the step's tokens."""
    import cache_node.sampler as sampler_mod

    seeded = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=1234)
    want = list(engine(tiny).generate([PROMPTS["plain"]], seeded)[0].output_token_ids)
    multinomial = torch.multinomial

    def draw(probs, n, generator=None):  # type: ignore[no-untyped-def]
        if isinstance(generator, _FailsAtDraw):
            generator.draws += 1
            if generator.draws > generator.at:
                raise RuntimeError("probability tensor contains inf, nan or element < 0")
            generator = generator.gen
        return multinomial(probs, n, generator=generator)

    monkeypatch.setattr(sampler_mod.torch, "multinomial", draw)
    eng = engine(tiny)
    eng.add_request(PROMPTS["plain"], seeded, request_id="a", tenant="A")  # drawn first in each step
    eng.add_request(PROMPTS["snapkv"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=1),
                    request_id="b", tenant="B")
    eng.requests["b"].generator = _FailsAtDraw(fail_at)
    final = run(eng)
    assert final["b"].finish_reason == "error"
    assert list(final["a"].output_token_ids) == want and final["a"].num_preemptions == 0
    assert eng.stats()["used_blocks"] == 0


def test_a_session_whose_first_turn_was_aborted_is_not_kept(tiny) -> None:
    """A fresh-user trial: six streamed first turns cut off by the client left six empty
    sessions open until their TTL. A first turn that ends aborted (or failed) leaves no
    session; one with history keeps it."""
    eng = engine(tiny)
    rid = eng.add_request(PROMPTS["plain"], PARAMS, session_id="s1", tenant="a")
    eng.step()
    eng.abort_request(rid)
    run(eng)
    assert "s1" not in eng.sessions.sessions and eng.stats()["sessions"] == 0
    eng.generate([PROMPTS["plain"]], PARAMS, session_id="s2", tenant="a")
    rid = eng.add_request(eng.session_history("s2") + [5], PARAMS, session_id="s2", tenant="a")
    eng.abort_request(rid)
    run(eng)
    assert eng.session_history("s2") is not None
    eng.close_session("s2")
    assert eng.stats()["used_blocks"] == 0


def test_the_canary_runs_the_prefill_and_the_decode_path(tiny, monkeypatch) -> None:
    """The canary after a failed step of one sequence runs a prefill and a decode (a failed
    step may have taken either path), and leaves no block held (diff review: a prefill-only
    canary passed on a node whose decode path was broken)."""
    eng = engine(tiny)
    assert eng._runner_works() and eng.stats()["used_blocks"] == 0
    execute = eng.runner.execute

    def decode_broken(batch, *a, **kw):  # type: ignore[no-untyped-def]
        if any(seq.num_computed_tokens > 0 for seq, _ in batch):
            raise RuntimeError("the decode kernel is broken")
        return execute(batch, *a, **kw)

    monkeypatch.setattr(eng.runner, "execute", decode_broken)
    assert not eng._runner_works() and eng.stats()["used_blocks"] == 0
    eng.check_integrity()
