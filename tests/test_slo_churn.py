"""kvstrata: no request is preempted and readmitted in alternation with another without
progress (a 64-block pool, 16-token blocks, a 64-token budget, 0.1 s steps, the bare
scheduler under ``tests.slo_sim``)."""

from __future__ import annotations

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import TenantShare
from cache_node.sequence import Sequence
from tests.slo_sim import Sim

Arrival = tuple[float, str, str, int, int]  # (time s, request id, tenant, prompt, max_tokens)


def run_arrivals(tenants: dict[str, TenantShare], arrivals: list[Arrival], max_seqs: int,
                 max_steps: int = 3000) -> Sim:
    sim = Sim("kvstrata", num_blocks=64, max_seqs=max_seqs, tenants=tenants)
    pending = sorted(arrivals)
    while (pending or sim.sched.has_work()) and sim.steps < max_steps:
        while pending and pending[0][0] <= sim.t:
            _, rid, tenant, prompt, max_tokens = pending.pop(0)
            sim.add(rid, tenant, prompt, max_tokens=max_tokens)
        sim.step()
    return sim


def test_interactive_request_that_cannot_grow_does_not_ping_pong_with_a_batch_one() -> None:
    """An interactive request (R0, 734-token prompt) that cannot grow beside an older one of
    its tenant preempts itself; a batch request below its floor (R3) takes the room. R0 comes
    back only when its prompt fits beside the running one, and it preempts R3 only when that
    lets it start. Before: R0's free cached prefix was counted as computed and as free, so it
    was readmitted (preempting R3) one step and preempted itself the next, every other step:
    119 preemptions in 423 steps."""
    tenants = {"t0": TenantShare("interactive", 5000.0, 4.0),
               "t1": TenantShare("batch", 5000.0, 50.0)}
    arrivals = [(1.13, "R3", "t1", 137, 200), (1.22, "R4", "t0", 121, 200),
                (2.40, "R2", "t0", 47, 64), (2.44, "R0", "t0", 734, 64),
                (2.86, "R1", "t0", 855, 8)]
    sim = run_arrivals(tenants, arrivals, max_seqs=4)
    assert sorted(sim.finished_step) == ["R0", "R1", "R2", "R3", "R4"]
    assert sim.sched.num_preemptions <= 8  # 5 seen
    # interactive before batch: every interactive request finishes before the batch one
    assert max(sim.finished_step[r] for r in ("R0", "R1", "R2", "R4")) < sim.finished_step["R3"]


@pytest.mark.parametrize(
    ("tenants", "arrivals", "max_seqs", "most_preemptions"),
    [
        # one slot: the batch request below its floor, preempted for the standard one's slot,
        # took it back the same step (first in the floor order): 13 preemptions in 13 steps
        ({"t0": TenantShare("standard", 5000.0, 10.0, 2.0),
          "t1": TenantShare("batch", 5000.0, 50.0, 1.0)},
         [(0.39, "R1", "t0", 371, 4), (0.39, "R3", "t1", 47, 64), (0.57, "R0", "t0", 158, 64),
          (1.24, "R2", "t0", 340, 64)], 1, 3),
        # two slots: a standard request that could not grow beside an older one preempted
        # itself, then a batch request below its floor for its slot: 72 preemptions
        ({"t0": TenantShare("standard", 5000.0, 0.0, 1.0),
          "t1": TenantShare("batch", 5000.0, 4.0, 2.0)},
         [(0.08, "R1", "t0", 588, 8), (0.39, "R3", "t0", 112, 8), (0.94, "R4", "t0", 468, 200),
          (1.97, "R2", "t1", 235, 200), (2.47, "R0", "t0", 294, 200)], 2, 6),
    ],
)
def test_a_victim_waits_for_the_request_it_was_preempted_for(
    tenants: dict[str, TenantShare], arrivals: list[Arrival], max_seqs: int, most_preemptions: int
) -> None:
    """A request preempted for a waiting one (a class preemption for a slot or for blocks)
    is not readmitted before that one has started, whatever the floor order says."""
    sim = run_arrivals(tenants, arrivals, max_seqs=max_seqs)
    assert len(sim.finished_step) == len(arrivals)
    assert sim.sched.num_preemptions <= most_preemptions


def test_a_free_cached_prefix_is_not_counted_as_free_room_for_the_rest_of_the_prompt() -> None:
    """An 8-block pool: 3 blocks held elsewhere, the 4 blocks of a 64-token prefix cached but
    free, 1 block free. A 80-token prompt with that prefix needs 6 blocks to its first token:
    the 4 it revives from the free list and 2 new ones, against 5 free blocks, so it does not
    fit; with one block more, it does. Before: the 4 hit blocks were counted as computed and
    as free (2 new blocks against 5), so it was admitted and could not reach its output."""
    sim = Sim("kvstrata", num_blocks=8)
    kv, sched = sim.kv, sim.sched
    first = sim.add("A", "a", 64, max_tokens=1)
    sim.run()
    assert "A" in sim.finished_step and kv.pool.num_free_blocks() == 8
    others = kv.pool.allocate(3)
    assert others is not None
    again = Sequence(request_id="A2", prompt_token_ids=first.prompt_token_ids + [7] * 16,
                     sampling_params=SamplingParams(max_tokens=4, ignore_eos=True),
                     extra_keys=("a",), tenant="a")
    hits = sched._hit_blocks(again)
    assert len(hits) == 4 and all(b.ref_cnt == 0 for b in hits)
    assert not sched._whole_prompt_fits(again, hits)
    kv.pool.free(others[:1])
    assert sched._whole_prompt_fits(again, hits)
