"""How long a queued request waits for its spill prefetch (``Scheduler._awaits_prefetch``).

Simulated clock and no model (``tests.slo_sim``): a prefetch that has not landed is a
``prefetch_until_s`` in the future, as ``TierManager.prefetch`` sets it.
"""

from __future__ import annotations

import pytest

from tests.slo_sim import BATCH, INTERACTIVE, STANDARD, Sim

TENANTS = {"chat": INTERACTIVE, "analyst": STANDARD, "bulk": BATCH}


def _sim(policy: str) -> Sim:
    """Prefill speed at the scheduler's prior (1000 tokens/s): steps of 0.1 s with fewer than a
    quarter of the 64-token budget never feed the meter."""
    return Sim(policy, num_blocks=128, budget=64, max_seqs=8, step_s=0.1, tenants=TENANTS)


@pytest.mark.parametrize(("policy", "first_token_step"), [("kvstrata", 0), ("fcfs", 11)])
def test_a_slow_prefetch_does_not_spend_a_short_interactive_requests_ttft(
    policy: str, first_token_step: int
) -> None:
    """Issue 21 (demo: interactive TTFT attainment 36%): every session's first call got a spill
    prefetch (``TierConfig.auto_prefetch``), and the scheduler passed it over until the
    prefetch landed or ``prefetch_wait_s`` (1 s) ran out. The demo's spill reads were slow, so
    the interactive tenant's first calls (plans and searches, 70-125 tokens, nothing in spill)
    all queued 1.07-1.27 s of their 2 s target on the node, against 6 ms for its turns that
    needed no prefetch. Under kvstrata a request now waits for its prefetch at most as long as
    recomputing its prompt takes (ski rental): 48 tokens at 1000 tokens/s is 48 ms, shorter than
    the step it would be passed over for (``step_s``, 50 ms before any step is measured), so it
    starts in the first step; fcfs keeps the old rule and waits the whole second (eleven 0.1 s
    steps in floats)."""
    sim = _sim(policy)
    seq = sim.add("q", "chat", prompt_len=48, max_tokens=2)
    seq.prefetch_until_s = 1.0  # a spill read in flight that will not land within a second
    sim.run()
    assert sim.first_token_step["q"] == first_token_step
    assert seq.num_computed_tokens == 48 + 1  # recomputed: nothing came from the spill tier


def test_a_prefetch_that_saves_more_than_its_wait_is_still_awaited() -> None:
    """The bound is what recomputing would cost, not zero: a 640-token prompt takes 0.64 s to
    recompute at 1000 tokens/s, and a tenth of the standard class's 5 s target is 0.5 s, so
    under kvstrata it waits for a prefetch due at 0.3 s, and meanwhile another tenant's request
    runs."""
    sim = _sim("kvstrata")
    seq = sim.add("long", "analyst", prompt_len=640, max_tokens=1)
    seq.prefetch_until_s = 0.3
    sim.add("other", "bulk", prompt_len=16, max_tokens=8)
    while "long" not in sim.started_order:
        sim.step()
    assert sim.started_order == ["other", "long"]
    assert sim.steps == 4  # started in step 3, at t = 0.3 s, when the prefetch is due


def test_the_bound_grows_with_the_prompt_left_past_the_device_hit() -> None:
    """The recompute cost counts only the tokens past the device prefix hit
    (``Sequence.device_hit_tokens``): with 608 of a 640-token prompt on the device, 32 tokens
    are left (32 ms), less than the 50 ms step it would be passed over for, so it does not wait.
    A request passed over waits a whole step: it waits only while the step after the next
    still starts within the bound."""
    sim = _sim("kvstrata")
    seq = sim.add("turn", "analyst", prompt_len=640, max_tokens=1)
    seq.prefetch_until_s = 5.0
    assert sim.sched.step_s.value == 0.05  # the prior: no step measured yet
    assert sim.sched._awaits_prefetch(seq, now=0.44)  # 640 tokens left: 0.64 s, capped at 0.5 s
    assert not sim.sched._awaits_prefetch(seq, now=0.45)  # 0.45 + a 0.05 s step reaches 0.5 s
    seq.device_hit_tokens = 608
    assert not sim.sched._awaits_prefetch(seq, now=0.0)


def test_an_interactive_turn_waits_at_most_a_tenth_of_its_ttft_target() -> None:
    """Issue 21, second demo run: the interactive tenant's session turns whose history had been
    demoted to the host tier during a tool pause (400-560 tokens, 370-540 of them in the host
    tier, none in spill) still queued 0.5-1.15 s waiting on their auto-prefetch, since
    recomputing ~500 tokens at the node's prefill speed bounds the wait at ~2 s. The wait is
    now also at most a tenth of the TTFT target: 0.1 s of chat's 1 s, whatever the prompt, less
    the 0.05 s step it would be passed over for."""
    sim = _sim("kvstrata")
    seq = sim.add("turn", "chat", prompt_len=640, max_tokens=1)
    seq.prefetch_until_s = 1.0
    assert sim.sched._awaits_prefetch(seq, now=0.04)
    assert not sim.sched._awaits_prefetch(seq, now=0.05)
    sim.run()
    assert sim.started_order == ["turn"] and sim.first_token_step["turn"] < 10 + 640 // 64
