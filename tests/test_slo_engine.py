"""SLO scheduling through the real engine (tiny random Llama, CPU) and the admission estimator."""

from __future__ import annotations

import dataclasses

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.model_loader import LoadedModel
from cache_node.outputs import InvalidRequestError
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import TenantShare
from cache_node.scheduling.admission import (
    CachedTokens,
    FluidBacklog,
    SpeedMeter,
    decide,
    estimate_ttft_s,
)
from cache_node.scheduling.kvstrata import KvstrataPolicy
from cache_node.tiers.manager import TierConfig


def engine(lm: LoadedModel, policy: str, host_blocks: int = 0, **cfg: int) -> LLMEngine:
    base = {
        "block_size": 16,
        "kv_pool_bytes": 1 << 20,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 2,
    }
    config = EngineConfig(scheduling_policy=policy, **{**base, **cfg})  # type: ignore[arg-type]
    eng = LLMEngine(lm.model, config, lm.model_id, lm.eos_token_ids)
    if host_blocks:
        tier = TierConfig(host_bytes=host_blocks * eng.pool.bytes_per_block)
        eng = LLMEngine(lm.model, config, lm.model_id, lm.eos_token_ids, tier_config=tier)
    for name, share in {"bulk": TenantShare("batch"), "live": TenantShare("interactive")}.items():
        eng.scheduler.policy.set_tenant(name, share)
    return eng


def prompt_of(n: int, offset: int) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def run(eng: LLMEngine, preempt_at_step: int | None) -> dict[str, tuple[int, ...]]:
    """Two 70-token batch requests decode; an interactive one arrives at ``preempt_at_step``."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for i in range(2):
        eng.add_request(prompt_of(70, i), params, request_id=f"bulk{i}", tenant="bulk")
    final: dict[str, tuple[int, ...]] = {}
    step = 0
    while eng.has_unfinished_requests():
        if step == preempt_at_step:
            eng.add_request(prompt_of(20, 9), params, request_id="live", tenant="live")
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
        step += 1
    return final


def test_preempted_request_swaps_to_host_and_resumes_with_identical_tokens(tiny) -> None:
    """Regression guard: a swap-preempted sequence must resume from its demoted blocks with
    exactly the tokens an unpreempted run gives."""
    reference = run(engine(tiny, "fcfs"), None)
    eng = engine(tiny, "kvstrata", host_blocks=64)
    got = run(eng, preempt_at_step=4)
    assert got["bulk0"] == reference["bulk0"] and got["bulk1"] == reference["bulk1"]
    assert eng.scheduler.num_preemptions == 1
    assert eng.tiers.counters["demoted_blocks"] == 4  # bulk1's 4 full blocks (70 + 3 tokens)
    assert eng.tiers.counters["promoted_host_blocks"] == 4
    eng.check_integrity()


def test_oversize_request_is_refused_and_others_complete(tiny) -> None:
    eng = engine(tiny, "kvstrata", max_num_seqs=4, kv_pool_bytes=1 << 19)  # 1024 tokens
    pool_tokens = eng.pool.num_blocks * eng.pool.block_size
    with pytest.raises(InvalidRequestError, match=f"KV pool holds {pool_tokens} tokens"):
        eng.add_request(prompt_of(pool_tokens - 8, 1), SamplingParams(max_tokens=64), tenant="bulk")
    small = eng.add_request(
        prompt_of(10, 2), SamplingParams(max_tokens=3, ignore_eos=True), tenant="live"
    )
    outs = {o.request_id: o for o in eng.step()}
    assert list(outs) == [small] and outs[small].new_token_ids
    assert eng.stats()["waiting"] == 0


def test_ttft_estimate_counts_queue_tiers_and_step() -> None:
    cached = CachedTokens(device=64, host=2000, spill=200, miss=100)
    # (300 ahead + 100 miss) / 400 + 2000 / 200k + 200 / 20k + 0.05
    assert estimate_ttft_s(300, cached, 400.0, 0.05) == pytest.approx(1.0 + 0.01 + 0.01 + 0.05)


def test_fluid_backlog_drains_higher_classes_first() -> None:
    q = FluidBacklog(class_order=True)
    q.add(2, "b", 1000.0, 1.0)
    q.add(0, "i", 300.0, 4.0)
    q.drain(now_s=1.0, tokens_per_s=200.0)  # updated_s starts at 0: 200 tokens drained
    assert q.by_rank == {2: 1000.0, 0: 100.0}
    assert q.ahead(0, "i", 10.0, 4.0) == 100.0 and q.ahead(2, "b", 10.0, 1.0) == 1100.0
    fcfs = FluidBacklog(class_order=False, by_tenant={(0, "i"): 5.0, (2, "b"): 7.0})
    assert fcfs.ahead(0, "i", 10.0, 4.0) == 12.0


def test_admission_interactive_rejects_standard_at_twice_batch_queues() -> None:
    assert decide("interactive", 1000.0, 900.0).admit
    no = decide("interactive", 1000.0, 2500.0, ahead_ms=2000.0)
    assert (no.admit, no.retry_after_s) == (False, 1.5)
    assert decide("standard", 5000.0, 9000.0).admit
    assert decide("standard", 5000.0, 10_050.0, ahead_ms=9000.0).retry_after_s == pytest.approx(0.1)
    assert decide("batch", 1000.0, 1e9).admit


def test_a_request_that_misses_its_limit_alone_is_admitted_with_nothing_ahead() -> None:
    """Regression: a 2k-token interactive prompt on an idle node (estimate 2088 ms, limit
    1000 ms) was refused with "retry after 1087 ms", and every retry was refused alike. With
    work ahead it is refused until that work is done; one that would meet its limit once the
    queue shrank keeps the old hint."""
    idle = decide("interactive", 1000.0, 2088.0, ahead_ms=0.0)
    assert idle.admit and "nothing ahead" in idle.reason
    busy = decide("interactive", 1000.0, 2588.0, ahead_ms=500.0)
    assert (busy.admit, busy.retry_after_s) == (False, 0.5)
    short = decide("interactive", 1000.0, 1500.0, ahead_ms=1200.0)  # alone: 300 ms
    assert (short.admit, short.retry_after_s) == (False, 0.5)


def test_speed_meter_takes_first_sample_then_averages() -> None:
    m = SpeedMeter(prior_tokens_per_s=1000.0, alpha=0.5)
    m.observe(100, 1.0)
    m.observe(300, 1.0)
    m.observe(0, 1.0)  # ignored
    assert m.tokens_per_s == 200.0


def test_two_floor_tenants_with_pool_filling_prompts_finish_on_the_engine(tiny) -> None:
    """The floor ping-pong on the real engine: a 64-block pool, no host tier, two standard
    tenants (4 tok/s floors, the floor window scaled to the tiny model's step: 0.1 s), one
    900-token request each. Both finish within 400 steps with few preemptions. Before: 72
    preemptions in 555 steps, each prefill thrown away by the other tenant's floor."""
    config = EngineConfig(block_size=16, kv_pool_bytes=1 << 20, max_num_batched_tokens=64,
                          max_num_seqs=4, scheduling_policy="kvstrata")
    probe = LLMEngine(tiny.model, config, tiny.model_id, tiny.eos_token_ids)
    config = dataclasses.replace(config, kv_pool_bytes=64 * probe.pool.bytes_per_block)
    eng = LLMEngine(tiny.model, config, tiny.model_id, tiny.eos_token_ids)
    policy = KvstrataPolicy(floor_window_s=0.1)
    eng.scheduler.policy = policy
    for tenant in ("a", "b"):
        policy.set_tenant(tenant, TenantShare("standard", 5000.0, 4.0, 2.0))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.add_request(prompt_of(900, 0), params, request_id="A", tenant="a")
    eng.add_request(prompt_of(900, 3), params, request_id="B", tenant="b")
    finished: set[str] = set()
    steps = 0
    while eng.has_unfinished_requests() and steps < 400:
        finished |= {out.request_id for out in eng.step() if out.finished}
        steps += 1
    assert finished == {"A", "B"}
    assert eng.scheduler.num_preemptions <= 8  # real clock: 0-3 seen (they take turns)
