"""SLO scheduling mechanisms on the bare scheduler (no model, no Ray), with a simulated clock:
orders, priorities, bursts, device hits, oversize requests and preemption. Each test drives
``Scheduler`` + ``KVCacheManager`` through ``tests.slo_sim.Sim`` and asserts exact orders.
"""

from __future__ import annotations

import pytest

from cache_node.config import EngineConfig
from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import SCHEDULING_POLICIES, make_policy
from cache_node.sequence import Sequence
from tests.slo_sim import BATCH, INTERACTIVE, STANDARD, Sim


def test_registry_names_and_unknown_name_lists_known() -> None:
    assert sorted(SCHEDULING_POLICIES) == ["fcfs", "kvstrata", "priority", "vtc"]
    with pytest.raises(
        ValueError, match=r"unknown scheduling policy 'edf'; known: \['fcfs', 'kvstrata'"
    ):
        make_policy("edf")
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        EngineConfig(scheduling_policy="edf")


def test_fcfs_keeps_head_of_line_blocking_and_queue_order() -> None:
    """The default: the first waiting request that does not fit ends admission for the step."""
    sim = Sim("fcfs", num_blocks=8, budget=512, max_seqs=8)
    sim.add("A", "t", 100)  # 7 blocks
    sim.add("B", "t", 40)  # 3 blocks: does not fit behind A
    sim.add("C", "t", 8)  # 1 block: would fit, but FCFS does not pass B
    assert sim.step() == [("A", 100)]
    assert [s.request_id for s in sim.sched.waiting] == ["B", "C"]


# ---- class priority -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["priority", "kvstrata"])
def test_high_priority_arrival_starts_within_one_step_when_slots_are_full(policy: str) -> None:
    sim = Sim(policy, max_seqs=4, budget=64, tenants={"bulk": BATCH, "live": INTERACTIVE})
    for i in range(4):
        sim.add(f"B{i}", "bulk", 16, max_tokens=50)
    for _ in range(3):
        sim.step()
    sim.add("I0", "live", 16, max_tokens=4)
    if policy == "priority":
        assert sim.step() == [("B0", 1), ("B1", 1), ("B2", 1), ("I0", 16)]
    else:  # kvstrata isolates the interactive prefill: one short step, then everyone decodes
        assert sim.step() == [("I0", 16)]
        # live is active, so the step is sized to its TTFT target and sorts decodes by class
        assert sim.step() == [("I0", 1), ("B0", 1), ("B1", 1), ("B2", 1)]
    assert [s.request_id for s in sim.sched.waiting] == ["B3"]  # the newest batch request
    assert sim.seqs["B3"].num_preemptions == 1


def test_fcfs_leaves_a_high_priority_arrival_waiting_when_slots_are_full() -> None:
    sim = Sim("fcfs", max_seqs=4, budget=64, tenants={"bulk": BATCH, "live": INTERACTIVE})
    for i in range(4):
        sim.add(f"B{i}", "bulk", 16, max_tokens=50)
    for _ in range(3):
        sim.step()
    sim.add("I0", "live", 16, max_tokens=4)
    assert sim.step() == [("B0", 1), ("B1", 1), ("B2", 1), ("B3", 1)]
    sim.run()
    assert sim.first_token_step["I0"] == 50  # only after a batch request finished


# ---- no head-of-line blocking ---------------------------------------------------------------
def burst(policy: str, same_tenant: bool) -> Sim:
    """40 long (400-token) prompts, then 120 short (20-token) ones, in one burst; the pool holds
    64 blocks of 16 tokens (two long prompts at a time)."""
    sim = Sim(
        policy, num_blocks=64, budget=256, max_seqs=16, tenants={"docs": STANDARD, "chat": STANDARD}
    )
    for i in range(40):
        sim.add(f"L{i}", "chat" if same_tenant else "docs", 400)
    for i in range(120):
        sim.add(f"S{i}", "chat", 20)
    sim.run()
    return sim


def last_first_token(sim: Sim, prefix: str, n: int) -> int:
    return max(sim.first_token_step[f"{prefix}{i}"] for i in range(n))


def test_burst_fcfs_holds_every_short_request_behind_the_long_ones() -> None:
    sim = burst("fcfs", same_tenant=True)
    first_short = min(sim.first_token_step[f"S{i}"] for i in range(120))
    assert first_short == last_first_token(sim, "L", 40) == 98
    assert last_first_token(sim, "S", 120) == 128


@pytest.mark.parametrize(
    ("same_tenant", "short_done_by", "long_done_by", "total_steps"),
    [(True, 28, 147, 151), (False, 37, 136, 140)],
)
def test_burst_kvstrata_serves_short_requests_past_the_long_ones(
    same_tenant: bool, short_done_by: int, long_done_by: int, total_steps: int
) -> None:
    """Short prompts that fit pass long ones that do not, and within one tenant the value
    order (pending time over prompt cost) takes the short ones first; aging and the growing
    value of waiting finish every long one (FCFS: 132 steps in all; one tenant here 150, as
    the long prompts run at the end, two at a time, with nothing left to batch beside them).
    A prompt is admitted only beside the blocks running prefills still need for theirs, so
    no admitted prefill is preempted (before: one preemption, and steps 34/135/139 with two
    tenants, 146/150 with one)."""
    sim = burst("kvstrata", same_tenant)
    assert last_first_token(sim, "S", 120) == short_done_by  # FCFS: 128
    assert last_first_token(sim, "L", 40) == long_done_by
    assert sim.steps == total_steps
    assert len(sim.finished_step) == 160
    assert sim.sched.num_preemptions == 0


def test_kvstrata_runs_a_device_hit_before_an_equal_miss() -> None:
    """Apt-Serve's hit/miss distinction: of two equal prompts from one tenant, the one whose
    prefix is on the device costs less to schedule and goes first, though it arrived later."""
    sim = Sim("kvstrata", num_blocks=64, budget=64, max_seqs=1, tenants={"t": STANDARD})

    def add(rid: str, tokens: list[int]) -> None:
        seq = Sequence(rid, tokens, SamplingParams(max_tokens=1, ignore_eos=True),
                       extra_keys=("t",), tenant="t", arrival_time_s=sim.t)
        sim.seqs[rid] = seq
        sim.sched.add(seq)

    doc = list(range(5000, 5064))  # 4 blocks
    add("warm", doc + [1])
    sim.run()
    add("miss", list(range(9000, 9069)))  # 69 tokens, nothing cached
    add("hit", doc + [2, 3, 4, 5, 6])  # 69 tokens, 64 on the device
    assert sim.step() == [("hit", 5)]
    assert sim.seqs["hit"].num_cached_tokens == 64
    sim.run()
    assert sim.started_order[-2:] == ["hit", "miss"]


# ---- oversize ----------------------------------------------------------------------------
def test_oversize_request_is_rejected_at_arrival_and_the_queue_moves() -> None:
    sim = Sim("kvstrata", num_blocks=8, budget=64)
    big = sim.add("BIG", "t", 100, max_tokens=40)  # 140 tokens > 8 blocks * 16
    sim.add("A", "t", 20)
    assert sim.sched.take_rejected() == [big]
    assert sim.step() == [("A", 20)]
    assert [s.request_id for s in sim.sched.waiting] == []


# ---- preemption keeps the place and the blocks -------------------------------------------
def test_preempted_request_readmitted_before_newer_equal_class_and_reuses_its_blocks() -> None:
    sim = Sim(
        "kvstrata",
        num_blocks=32,
        budget=64,
        max_seqs=1,
        tenants={"std": STANDARD, "std2": STANDARD, "live": INTERACTIVE},
    )
    a = sim.add("A", "std", 40, max_tokens=8)
    sim.step()  # A prefills 40 tokens and samples its first token
    blocks_a = [b.block_id for b in a.block_table]
    sim.t += 1.0
    sim.add("B", "std2", 20, max_tokens=2)  # newer, same class, another tenant (lower VTC)
    sim.add("I", "live", 8, max_tokens=2)
    assert sim.step() == [("I", 8)]  # A preempted for the interactive request
    assert [s.request_id for s in sim.sched.waiting] == ["A", "B"]
    assert sim.step() == [("I", 1)]
    batch = sim.step()  # I finished; A comes back before B, from its cached blocks
    assert batch == [("A", 9)]  # 41 tokens known, 32 cached in 2 full blocks
    assert [b.block_id for b in a.block_table][:2] == blocks_a[:2]
    assert a.num_computed_tokens == 41


def test_preemption_demotes_when_the_copy_is_cheaper_than_recomputing() -> None:
    demoted: list[list[int]] = []

    def demote(blocks: list) -> int:
        demoted.append([b.block_id for b in blocks])
        return len(blocks)

    for bytes_per_block, expect_swap in ((1 << 20, True), (1 << 34, False)):
        demoted.clear()
        sim = Sim(
            "kvstrata", num_blocks=32, max_seqs=1, tenants={"bulk": BATCH, "live": INTERACTIVE}
        )
        sim.sched.attach_swap(demote, bytes_per_block, copy_bytes_per_s=4e9)
        a = sim.add("A", "bulk", 40, max_tokens=8)
        sim.step()
        ids = [b.block_id for b in a.block_table[:2]]
        sim.add("I", "live", 8)
        sim.step()
        # 2 blocks: 2 MiB round trip at 4 GB/s ~ 0.5 ms < 32 tokens at 1000 tokens/s = 32 ms
        assert demoted == ([ids] if expect_swap else [])


# ---- floors and fair sharing -----------------------------------------------------------
