"""Engine on a tiny random Llama: batching equivalence, prefix cache, sessions, bad input."""

from __future__ import annotations

import time

import pytest
import torch

from cache_node.hashing import HashFn
from cache_node.model_loader import tiny_llama
from cache_node.outputs import InvalidRequestError
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def hf_greedy(prompt: list[int], max_new: int) -> list[int]:
    ref = tiny_llama(seed=0).model
    ref.config._attn_implementation = "sdpa"
    ids = torch.tensor([prompt])
    # the mask given (review 30a N1): without it transformers infers one from pad_token_id, masking
    # every prompt token of that id once eos_token_id is None
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def test_batch_equals_hf_generate_with_chunked_prefill(tiny) -> None:
    """Different lengths in one flattened batch, prefill chunked by a 64-token budget."""
    eng = make_engine(tiny, max_num_batched_tokens=64)
    prompts = [prompt_of(n, n) for n in (1, 5, 16, 33, 90, 150)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.output_token_ids) == hf_greedy(p, 12)
    eng.check_integrity()


def test_repeated_prompt_hits_prefix_cache_with_identical_output(tiny) -> None:
    eng = make_engine(tiny)
    p = prompt_of(70)
    first = eng.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    second = eng.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64 >= len(p) - 16
    assert second.output_token_ids == first.output_token_ids


@pytest.mark.parametrize("n", [1, 16, 32, 48])
def test_block_aligned_and_one_token_prompts(tiny, n) -> None:
    """A fully cached block-aligned prompt still recomputes its last token."""
    eng = make_engine(tiny)
    p = prompt_of(n, 3)
    a = eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    b = eng.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert b.num_cached_tokens == ((n - 1) // 16) * 16
    assert a.output_token_ids == b.output_token_ids == tuple(hf_greedy(p, 4))


def test_prompt_plus_completion_resend_reuses_everything_computed(tiny) -> None:
    eng = make_engine(tiny)
    p = prompt_of(40)
    a = eng.generate([p], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    full = p + list(a.output_token_ids)
    b = eng.generate([full], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert b.num_cached_tokens == ((len(full) - 1) // 16) * 16 == 64
    assert list(b.output_token_ids) == hf_greedy(full, 5)


def test_namespaces_isolate_and_share(tiny) -> None:
    eng = make_engine(tiny)
    p = prompt_of(50)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    eng.generate([p], params, cache_namespace="tenant-a")
    other = eng.generate([p], params, cache_namespace="tenant-b")[0]
    same = eng.generate([p], params, cache_namespace="tenant-a")[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 48


def test_forced_hash_collision_is_a_miss(tiny) -> None:
    """Regression: a weak hash mapping every block to one value must not serve wrong KV."""
    weak: HashFn = lambda data: b"\x00" * 32
    from cache_node.config import EngineConfig
    from cache_node.engine import LLMEngine

    eng = LLMEngine(tiny.model, EngineConfig(block_size=16, kv_pool_bytes=1 << 20), "t", [], weak)
    a, b = prompt_of(40, 1), prompt_of(40, 2)
    eng.generate([a], SamplingParams(max_tokens=3, ignore_eos=True))
    out = eng.generate([b], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0
    assert list(out.output_token_ids) == hf_greedy(b, 3)


def test_session_turn_prefills_only_new_tokens(tiny) -> None:
    eng = make_engine(tiny)
    p1 = prompt_of(37)
    t1 = eng.generate([p1], SamplingParams(max_tokens=6, ignore_eos=True), session_id="s", tenant="a")[0]
    history = p1 + list(t1.output_token_ids)
    p2 = history + prompt_of(9, 5)
    t2 = eng.generate([p2], SamplingParams(max_tokens=4, ignore_eos=True), session_id="s", tenant="a")[0]
    assert t2.num_cached_tokens == len(history) - 1
    assert list(t2.output_token_ids) == hf_greedy(p2, 4)
    assert eng.close_session("s") == len(p2) + 4
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0


@pytest.mark.parametrize("old_ends", ["finished", "aborted"])
def test_a_turn_of_a_closed_session_leaves_its_reopened_session_alone(tiny, old_ends: str) -> None:
    """Regression (hangs review L1): a session closed while its turn ran and opened again by a
    new turn took the old turn's end as its history (finished), or was deleted (aborted), and
    its running turn was cleared, so a second turn could attach alongside the new one."""
    eng = make_engine(tiny)
    old, new = list(range(1, 30)), list(range(100, 110))
    eng.add_request(old, SamplingParams(max_tokens=20, ignore_eos=True), request_id="old", session_id="S")
    eng.step()
    eng.step()
    assert eng.close_session("S") == 0
    eng.add_request(new, SamplingParams(max_tokens=30, ignore_eos=True), request_id="new", session_id="S")
    if old_ends == "aborted":
        assert eng.abort_request("old")
    done: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == "old" and out.finished:
                assert "new" not in done  # (it has more tokens to go)
                assert eng.sessions.sessions["S"].active_request == "new"
            if out.finished:
                done[out.request_id] = list(out.output_token_ids)
    assert eng.session_history("S") == new + done["new"]
    eng.check_integrity()


def test_aborted_session_turn_leaves_no_trace(tiny) -> None:
    eng = make_engine(tiny)
    p1 = prompt_of(20)
    t1 = eng.generate([p1], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a")[0]
    history = p1 + list(t1.output_token_ids)
    rid = eng.add_request(history + [9, 9, 9], SamplingParams(max_tokens=50), session_id="s", tenant="a")
    eng.step()
    assert eng.abort_request(rid)
    eng.step()
    assert eng.sessions.sessions["s"].token_ids == history
    p3 = history + [4, 5]
    t3 = eng.generate([p3], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a")[0]
    assert list(t3.output_token_ids) == hf_greedy(p3, 3)


def test_compressed_session_turn_keeps_its_history(tiny) -> None:
    """Regression: a turn whose KV a policy compacted was dropped from the session's history,
    so the next turn lost the conversation. Now the history grows; a next turn under another
    policy (here the full cache) prefills it again (tests/test_session_policy.py)."""
    eng = make_engine(tiny)
    p1 = prompt_of(60)
    t1 = eng.generate([p1], SamplingParams(max_tokens=4, ignore_eos=True), session_id="s", tenant="a",
                      policy="streaming-24")[0]
    history = p1 + list(t1.output_token_ids)
    assert eng.session_history("s") == history
    assert eng.sessions.sessions["s"].compacted  # kept for a next turn of the same policy
    p2 = history + prompt_of(5, 3)
    t2 = eng.generate([p2], SamplingParams(max_tokens=3, ignore_eos=True), session_id="s", tenant="a")[0]
    assert t2.num_prompt_tokens == len(p2)
    assert list(t2.output_token_ids) == hf_greedy(p2, 3)  # the full-cache turn sees the whole history
    assert eng.session_history("s") == p2 + list(t2.output_token_ids)
    eng.check_integrity()


def test_session_of_another_tenant_is_refused(tiny) -> None:
    eng = make_engine(tiny)
    eng.generate([prompt_of(5)], SamplingParams(max_tokens=1), session_id="s", tenant="a")
    with pytest.raises(PermissionError):
        eng.add_request(prompt_of(9), SamplingParams(max_tokens=1), session_id="s", tenant="b")


def test_seeded_sampling_is_deterministic(tiny) -> None:
    eng = make_engine(tiny)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=42, ignore_eos=True)
    a, b = eng.generate([prompt_of(12), prompt_of(12)], sp)
    assert a.output_token_ids == b.output_token_ids
    c = eng.generate([prompt_of(12)], SamplingParams(max_tokens=10, temperature=0.9, seed=7, ignore_eos=True))[0]
    assert c.output_token_ids != a.output_token_ids


def test_stop_token_and_max_tokens(tiny) -> None:
    eng = make_engine(tiny)
    p = prompt_of(10)
    ref = hf_greedy(p, 6)
    out = eng.generate([p], SamplingParams(max_tokens=6, stop_token_ids=(ref[2],)))[0]
    assert out.finish_reason == "stop" and list(out.output_token_ids) == ref[: ref.index(ref[2]) + 1]
    out = eng.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 6


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], {}, "empty"),
        ([1] * 3000, {}, "model context"),
        ([1, 2, 600], {}, "outside"),
        ([1, 2], {"stop_token_ids": (99999,)}, "unknown stop"),
    ],
)
def test_bad_input_is_rejected_and_others_finish(tiny, prompt, params, match) -> None:
    eng = make_engine(tiny)
    good = eng.add_request(prompt_of(20), SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(InvalidRequestError, match=match):
        eng.add_request(prompt, SamplingParams(max_tokens=2, **params))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert done[good].num_output_tokens == 3
    eng.check_integrity()


def test_prompt_larger_than_pool_is_rejected(tiny) -> None:
    eng = make_engine(tiny, kv_pool_bytes=16 * 1024 * 16)  # 32 blocks of 16 tokens
    with pytest.raises(InvalidRequestError, match="KV pool holds"):
        eng.add_request(prompt_of(600), SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    "kwargs", [{"max_tokens": 0}, {"max_tokens": -1}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
               {"seed": -1}, {"seed": 2**64}, {"temperature": 1e-300, "seed": 2**70}],
)
def test_invalid_sampling_params(kwargs) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_a_vanishing_temperature_decodes_greedily(tiny) -> None:
    """Regression: temperature 1e-300 passed validation, and dividing the logits by it gave
    inf, whose softmax is NaN: torch.multinomial raised inside the step (the node's step
    loop died). Temperatures under ``GREEDY_BELOW`` decode greedily, as in vLLM."""
    prompt = prompt_of(12)
    greedy = make_engine(tiny).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    for t in (1e-300, 5e-324, 9e-6):
        sp = SamplingParams(max_tokens=6, ignore_eos=True, temperature=t, seed=2**64 - 1)
        assert sp.greedy and make_engine(tiny).generate([prompt], sp)[0].output_token_ids == greedy.output_token_ids
    assert not SamplingParams(temperature=1e-5).greedy


def test_idle_sessions_are_unpinned_when_the_pool_is_full(tiny) -> None:
    """Regression: pinned idle sessions filled the pool and new requests waited forever."""
    eng = make_engine(tiny, kv_pool_bytes=12 * 8192, max_num_seqs=4)  # 12 blocks of 16 tokens
    for i in range(3):  # each session pins 3 blocks (40 prompt + 6 output tokens)
        eng.generate([prompt_of(40, i)], SamplingParams(max_tokens=6, ignore_eos=True),
                     session_id=f"s{i}", tenant="a")
    assert eng.stats()["used_blocks"] == 9
    out = eng.generate([prompt_of(90, 9)], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.num_output_tokens == 4 and list(out.output_token_ids) == hf_greedy(prompt_of(90, 9), 4)
    assert eng.sessions.sessions["s0"].blocks == []  # the least recently used went first
    eng.check_integrity()


def test_token_times_include_the_steps_compression(tiny, monkeypatch) -> None:
    """Regression: a token's time was taken before the policies compressed the step's KV, so
    the prompt's compression (waited for by the caller, who gets the first token when the
    step returns) counted in the second token's gap, not in TTFT."""
    from cache_node.kv_state import SequenceKV

    done: list[float] = []
    real = SequenceKV.after_step

    def timed(self):  # type: ignore[no-untyped-def]
        out = real(self)
        done.append(time.monotonic())
        return out

    monkeypatch.setattr(SequenceKV, "after_step", timed)
    eng = make_engine(tiny)
    rid = eng.add_request([(i % 50) + 1 for i in range(200)], SamplingParams(max_tokens=3, ignore_eos=True),
                          policy="snapkv-64")
    seq = eng.requests[rid]
    while seq.first_token_time_s is None:
        eng.step()
    assert done and seq.first_token_time_s >= done[-1]
