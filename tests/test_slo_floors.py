"""Token-rate floors on the bare scheduler (no model, no Ray), with a simulated clock:
floor-sized steps, the step-time model, decodes that sit out, and VTC's weighted service
(``tests.slo_sim.Sim``).
"""

from __future__ import annotations

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import TenantShare
from cache_node.scheduling.admission import StepTimeModel
from cache_node.sequence import Sequence
from tests.slo_sim import INTERACTIVE, Sim, backlogged_window_rates


def floods(policy: str) -> Sim:
    """A heavy tenant (weight 4) floods 60 requests; a light one (weight 1) has a floor of
    8 tokens/s; 4 running slots; a step is 0.1 s, so one running request decodes 10 tokens/s."""
    tenants = {
        "heavy": TenantShare("standard", weight=4.0),
        "light": TenantShare("standard", weight=1.0, min_tokens_per_s=8.0),
    }
    sim = Sim(policy, num_blocks=256, max_seqs=4, budget=64, tenants=tenants)
    for i in range(60):
        sim.add(f"H{i}", "heavy", 16, max_tokens=40)
    for i in range(10):
        sim.add(f"L{i}", "light", 16, max_tokens=40)
    sim.run()
    return sim


def test_floor_met_for_backlogged_tenant_while_heavier_tenant_floods() -> None:
    rates = backlogged_window_rates(floods("kvstrata"), "light")
    assert len(rates) == 12
    assert min(rates) >= 8.0, rates


def floor_under_prefill(policy: str) -> list[float]:
    """Steps cost 50 ms + 2 ms per token. A batch tenant floods 512-token prompts (a 256-token
    budget: ~0.56 s steps); after 4 s a light tenant starts one 60-token decode with a floor of
    4 tokens/s. Returns the light tenant's tokens/s (prefill and output tokens, as floors count
    them) in each whole 2 s window from its arrival to its finish."""
    tenants = {"bulk": TenantShare("batch", weight=1.0),
               "light": TenantShare("standard", weight=1.0, min_tokens_per_s=4.0)}
    sim = Sim(policy, num_blocks=1024, max_seqs=8, budget=256, tenants=tenants,
              step_time=lambda n: 0.05 + 0.002 * n)
    for i in range(40):
        sim.add(f"B{i}", "bulk", 512, max_tokens=4)
    while sim.t < 4.0:
        sim.step()
    arrival = sim.t
    sim.add("L", "light", 16, max_tokens=60)
    while "L" not in sim.finished_step:
        sim.step()
    windows = [arrival + 2.0 * k for k in range(int((sim.t - arrival) // 2.0))]
    return [sum(n for t, n in sim.tokens["light"] if w <= t < w + 2.0) / 2.0 for w in windows]


def test_floor_sized_steps_keep_a_decoding_tenant_at_its_floor_under_long_prefills() -> None:
    """kvstrata caps the step's tokens (step-time model fitted online) while a tenant with a
    floor decodes; vtc keeps full 256-token steps, ~0.56 s each: < 2 decode tokens/s."""
    kv = floor_under_prefill("kvstrata")
    assert len(kv) >= 4 and min(kv) >= 4.0, kv
    vtc = floor_under_prefill("vtc")
    assert max(vtc[1:]) < 4.0, vtc  # the first window holds its 16 prefill tokens


def test_floor_sized_steps_exempt_an_interactive_prefill() -> None:
    """While the light tenant decodes under floor-sized steps (~78 tokens of other prefill a
    step), an interactive 512-token prompt is not cut to that size (its TTFT): it is admitted with the
    whole 256-token budget and finishes its prompt in 3 steps (256 + 128 + 128); the batch
    tenant's chunks next to it stay within the floor-sized budget."""
    tenants = {"bulk": TenantShare("batch", weight=1.0),
               "light": TenantShare("standard", weight=1.0, min_tokens_per_s=4.0),
               "live": INTERACTIVE}
    sim = Sim("kvstrata", num_blocks=1024, max_seqs=8, budget=256, tenants=tenants,
              step_time=lambda n: 0.05 + 0.002 * n)
    for i in range(40):
        sim.add(f"B{i}", "bulk", 512, max_tokens=4)
    sim.add("L", "light", 16, max_tokens=60)
    while sim.t < 4.0:
        sim.step()
    assert len(sim.seqs["L"].output_token_ids) > 1  # decoding: floor-sized steps are on
    sim.add("I", "live", 512, max_tokens=4)
    steps = []
    while "I" not in sim.first_token_step:
        steps.append(dict(sim.step()))
    assert [s["I"] for s in steps] == [256, 128, 128]
    bulk = [sum(n for r, n in s.items() if r.startswith("B") and n > 1) for s in steps]
    assert bulk[0] == 0 and bulk[2] == 0  # the isolated steps
    # the step model has seen only full steps (2.2 ms a token): 1 / (4 * 1.2) s holds 94
    # tokens, less 3 decodes; uncapped, the batch tenant would take the 125 tokens left
    assert bulk[1] == 91


def test_isolated_step_gives_a_running_interactive_prefill_the_whole_budget() -> None:
    """Batch requests wait; an interactive 600-token prompt starts in an isolated step (256
    tokens), shares the next, mixed step (half the budget, 128: the batch requests may join
    it) and takes the rest, 216 tokens, in the next isolated step, where no waiting request
    could join it."""
    tenants = {"bulk": TenantShare("batch", weight=1.0), "live": INTERACTIVE}
    sim = Sim("kvstrata", num_blocks=1024, max_seqs=4, budget=256, tenants=tenants)
    for i in range(8):
        sim.add(f"B{i}", "bulk", 300, max_tokens=4)
    sim.step()
    sim.add("I", "live", 600, max_tokens=4)
    chunks = []
    while "I" not in sim.first_token_step:
        chunks.append(dict(sim.step()).get("I"))
    assert chunks == [256, 128, 216]


def test_step_time_model_fits_base_prefill_and_decode_costs() -> None:
    model = StepTimeModel(min_samples=4)
    assert model.step_budget(0.2, decodes=4, least_decodes=1, cap=256) is None  # no fit yet
    for p, d in ((16, 1), (64, 4), (128, 0), (256, 8), (32, 12)):
        model.observe(p, d, 0.05 + 0.002 * p + 0.01 * d)
    base, per_token, per_decode = model.fit()
    assert (base, per_token, per_decode) == pytest.approx((0.05, 0.002, 0.01))
    # 4 decodes (0.04 s), then (0.2 - 0.05 - 0.04) / 0.002 = 55 prefill tokens
    assert model.step_budget(0.2, decodes=4, least_decodes=1, cap=256) == (4, 55)
    # 30 decodes do not fit: (0.2 - 0.05) / 0.01 = 15 of them, no prefill
    assert model.step_budget(0.2, decodes=30, least_decodes=1, cap=256) == (15, 0)
    # the floors' decodes always run
    assert model.step_budget(0.01, decodes=30, least_decodes=3, cap=256) == (3, 0)


def test_step_time_model_one_cost_per_token_when_steps_do_not_separate_the_costs() -> None:
    model = StepTimeModel(min_samples=4)
    for p in (16, 64, 128, 255):
        model.observe(p, 1, 0.05 + 0.002 * (p + 1))  # always one decode: no decode cost of its own
    assert model.fit() == pytest.approx((0.05, 0.002, 0.002))


def test_step_time_model_plans_with_the_quantile_of_its_misses() -> None:
    """Steps that take 1.0x or 1.5x the fitted time (alternately): planning with the 0.9
    quantile of actual / fitted seconds keeps the slow steps within the bound as well."""
    model = StepTimeModel(min_samples=4, quantile=0.9)
    for i, (p, d) in enumerate(((16, 1), (64, 4), (128, 0), (256, 8), (32, 12), (100, 2)) * 4):
        model.observe(p, d, (0.05 + 0.002 * p + 0.01 * d) * (1.5 if i % 2 else 1.0))
    d, p = model.step_budget(0.5, decodes=4, least_decodes=1, cap=256)
    assert model.margin(model.fit()) > 1.2  # the fit itself sits between the two speeds
    assert 1.5 * (0.05 + 0.002 * p + 0.01 * d) <= 0.5 and d == 4 and p > 0


def floor_under_decodes(policy: str, bulk_floor: float = 0.0) -> tuple[list[float], int]:
    """Each decode costs 30 ms (a prefill token 2 ms, a step 50 ms). A batch tenant (its floor
    ``bulk_floor`` tokens/s) has 15 long decodes running; a light tenant with a floor of 4
    tokens/s starts one 60-token decode. Returns the light tenant's tokens/s in each whole 2 s
    window from its arrival to its finish, and the most steps any batch request went without
    a token meanwhile."""
    tenants = {"bulk": TenantShare("batch", weight=1.0, min_tokens_per_s=bulk_floor),
               "light": TenantShare("standard", weight=1.0, min_tokens_per_s=4.0)}
    sim = Sim(policy, num_blocks=1024, max_seqs=16, budget=256, tenants=tenants,
              step_cost=lambda p, d: 0.05 + 0.002 * p + 0.03 * d)
    for i in range(15):
        sim.add(f"B{i}", "bulk", 16 * (1 + i % 3), max_tokens=400)
    while sim.t < 3.0:
        sim.step()
    arrival = sim.t
    sim.add("L", "light", 16, max_tokens=60)
    last = {f"B{i}": sim.steps for i in range(15)}
    gap = 0
    while "L" not in sim.finished_step:
        for rid, _ in sim.step():
            if rid in last:
                gap = max(gap, sim.steps - last[rid])
                last[rid] = sim.steps
    windows = [arrival + 2.0 * k for k in range(int((sim.t - arrival) // 2.0))]
    return [sum(n for t, n in sim.tokens["light"] if w <= t < w + 2.0) / 2.0 for w in windows], gap


def test_decodes_without_a_floor_sit_out_when_the_decode_batch_would_break_a_floor() -> None:
    """16 decodes take 0.53 s a step: 1.9 tokens/s for the light tenant under vtc. kvstrata
    fits the step to 1 / (4 * 1.2) s: the light decode and 4 batch decodes, the batch
    requests taking turns (each decodes at least every 4th step)."""
    kv, gap = floor_under_decodes("kvstrata")
    assert len(kv) >= 4 and min(kv) >= 4.0, kv
    assert gap <= 4, gap
    vtc, _ = floor_under_decodes("vtc")
    assert max(vtc[1:]) < 4.0, vtc  # the first window holds its 16 prefill tokens


def test_a_small_floor_does_not_keep_every_decode_of_its_tenant_in_the_step() -> None:
    """Regression (issue 21, make demo): the batch tenants there have a 0.5 tok/s floor, and
    every decode of a tenant with a floor counted as needed, so a step could never be shorter
    than all of them: the interactive tenant's lone decode ran at 262 ms a token against its
    4 tok/s floor. A floor now keeps only the decodes it needs a step (``floor_decodes``:
    one here); the batch tenant's others take turns, and its rate stays far above 0.5."""
    light, gap = floor_under_decodes("kvstrata", bulk_floor=0.5)
    assert len(light) >= 4 and min(light) >= 4.0, light
    assert gap <= 4, gap


def test_vtc_alone_misses_the_floor_of_the_light_tenant() -> None:
    rates = backlogged_window_rates(floods("vtc"), "light")
    assert sum(r < 8.0 for r in rates) >= 10, rates


def test_vtc_counters_charge_uncached_prefill_and_output_tokens_by_weight() -> None:
    sim = Sim("vtc", tenants={"a": TenantShare(weight=2.0), "b": TenantShare(weight=1.0)})
    first = sim.add("A0", "a", 40, max_tokens=3)
    sim.run()
    sim.t += 1.0
    again = Sequence(
        "A1",
        list(first.prompt_token_ids),
        SamplingParams(max_tokens=3, ignore_eos=True),
        extra_keys=("a",),
        tenant="a",
        arrival_time_s=sim.t,
    )
    sim.sched.add(again)  # same prompt: 32 tokens come from the prefix cache
    sim.add("B0", "b", 10, max_tokens=3)
    sim.run()
    vtc = sim.sched.policy.vtc  # type: ignore[attr-defined]
    assert vtc.counter("a") == (40 + 2) / 2 + (8 + 2) / 2  # uncached prefill + decode steps
    assert vtc.counter("b") == 21.0 + 10 + 2  # lifted to a's counter when it arrived


def test_vtc_interleaves_tenants_by_weighted_service() -> None:
    sim = Sim(
        "vtc",
        budget=16,
        max_seqs=1,
        tenants={"a": TenantShare(weight=1.0), "b": TenantShare(weight=3.0)},
    )
    for i in range(4):
        sim.add(f"a{i}", "a", 8, max_tokens=1)
    for i in range(4):
        sim.add(f"b{i}", "b", 8, max_tokens=1)
    sim.run()
    assert sim.started_order == ["a0", "b0", "b1", "b2", "a1", "b3", "a2", "a3"]


@pytest.mark.parametrize(("max_tokens", "most_steps", "most_preemptions"), [(8, 80, 0), (100, 600, 10)])
def test_two_floor_tenants_with_pool_filling_prompts_take_turns_and_both_finish(
    max_tokens: int, most_steps: int, most_preemptions: int
) -> None:
    """Two standard tenants (4 tok/s floors), one request each whose prompt nearly fills the
    pool: only one runs at a time, and each prefill (~28 steps, 2.8 s) outlasts the 2 s floor
    window. The waiting one, below its floor, takes the running one only after that one's
    turn (its prefill, then as long again of decoding, at most one window): short outputs
    finish with no preemption, long ones take turns, and the waiting tenant is served before
    the other finishes. Before: each preempted the other's prefill forever (310 preemptions,
    nothing finished in 6000 steps)."""
    std = TenantShare("standard", ttft_slo_ms=5000.0, min_tokens_per_s=4.0, weight=2.0)
    sim = Sim("kvstrata", num_blocks=64, tenants={"a": std, "b": std})
    sim.add("A", "a", 1010 - max_tokens, max_tokens=max_tokens)
    sim.add("B", "b", 1010 - max_tokens, max_tokens=max_tokens)
    sim.run(max_steps=2000)
    assert sorted(sim.finished_step) == ["A", "B"]
    assert sim.steps <= most_steps
    assert sim.sched.num_preemptions <= most_preemptions
    first, second = sorted(sim.finished_step, key=sim.finished_step.__getitem__)
    if max_tokens > 8:  # long outputs: the waiting tenant's floor gets it a turn
        assert sim.first_token_step[second] < sim.finished_step[first]


def test_class_preemption_for_a_slot_only_when_the_waiting_request_can_start() -> None:
    """Two slots; a standard request whose prompt does not fit beside the running one waits
    while a batch tenant below its floor runs. The standard one preempts the batch request for
    its slot only when the freed blocks let it start. Before: it preempted the batch request
    every step, which (below its floor, so first in the waiting order) came straight back
    into the slot: 66 preemptions."""
    tenants = {"std": TenantShare("standard"),
               "live": TenantShare("interactive", min_tokens_per_s=10.0),
               "bulk": TenantShare("batch", min_tokens_per_s=10.0)}
    arrivals = [(0.57, "R0", "live", 501, 200), (1.27, "R2", "bulk", 127, 64),
                (2.10, "R1", "std", 367, 200), (3.03, "R3", "std", 1004, 8)]
    sim = Sim("kvstrata", num_blocks=64, max_seqs=2, tenants=tenants)
    while (arrivals or sim.sched.has_work()) and sim.steps < 2000:
        while arrivals and arrivals[0][0] <= sim.t:
            _, rid, tenant, prompt, max_tokens = arrivals.pop(0)
            sim.add(rid, tenant, prompt, max_tokens=max_tokens)
        sim.step()
    assert len(sim.finished_step) == 4
    assert sim.sched.num_preemptions <= 2
