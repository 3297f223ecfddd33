"""SLO scheduling mechanisms on the bare scheduler (no model, no Ray), with a simulated clock.

Each test drives ``Scheduler`` + ``KVCacheManager`` through a tiny step simulator that does
what the engine does after a forward pass (count computed tokens, cache full blocks, append one
output token per sampled sequence, finish at ``max_tokens``) and asserts exact orders.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from cache_node.config import EngineConfig
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.sampling_params import SamplingParams
from cache_node.scheduler import Scheduler
from cache_node.scheduling.admission import StepTimeModel
from cache_node.scheduling import SCHEDULING_POLICIES, SchedulingPolicy, TenantShare, make_policy
from cache_node.sequence import Sequence

INTERACTIVE = TenantShare("interactive", ttft_slo_ms=1000.0, weight=4.0)
STANDARD = TenantShare("standard", ttft_slo_ms=5000.0, weight=2.0)
BATCH = TenantShare("batch", ttft_slo_ms=60000.0, weight=1.0)


class Sim:
    """The engine's step loop without a model: one fake output token per sampled sequence."""

    def __init__(
        self,
        policy: str | SchedulingPolicy,
        num_blocks: int = 64,
        block_size: int = 16,
        budget: int = 64,
        max_seqs: int = 4,
        step_s: float = 0.1,
        tenants: dict[str, TenantShare] | None = None,
        step_time: Callable[[int], float] | None = None,
        step_cost: Callable[[int, int], float] | None = None,
    ) -> None:
        self.t, self.step_s, self.steps = 0.0, step_s, 0
        self.step_time = step_time  # seconds of a step of n tokens (default: ``step_s``)
        self.step_cost = step_cost  # seconds of a step of (prefill tokens, decodes)
        cfg = EngineConfig(
            block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs
        )
        self.kv = KVCacheManager(num_blocks, block_size)
        pol = make_policy(policy) if isinstance(policy, str) else policy
        for name, share in (tenants or {}).items():
            pol.set_tenant(name, share)
        self.sched = Scheduler(cfg, self.kv, policy=pol, clock=lambda: self.t)
        self.seqs: dict[str, Sequence] = {}
        self.first_token_step: dict[str, int] = {}
        self.finished_step: dict[str, int] = {}
        self.started_order: list[str] = []
        self.tokens: dict[str, list[tuple[float, int]]] = defaultdict(list)  # tenant -> (t, n)

    def add(self, rid: str, tenant: str, prompt_len: int, max_tokens: int = 4) -> Sequence:
        base = 10_000 * (len(self.seqs) + 1)  # distinct prompts: no accidental prefix hits
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=[base + i for i in range(prompt_len)],
            sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            extra_keys=(tenant,),
            tenant=tenant,
            arrival_time_s=self.t,
        )
        self.seqs[rid] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> list[tuple[str, int]]:
        batch = self.sched.schedule()
        for seq, n in batch:
            if seq.request_id not in self.started_order:
                self.started_order.append(seq.request_id)
            seq.num_computed_tokens += n
            self.tokens[seq.tenant].append((self.t, n))
            self.kv.cache_full_blocks(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(7)
                self.first_token_step.setdefault(seq.request_id, self.steps)
                if len(seq.output_token_ids) >= seq.sampling_params.max_tokens:
                    self.sched.finish(seq)
                    self.kv.free(seq)
                    self.finished_step[seq.request_id] = self.steps
        self.steps += 1
        if self.step_cost is not None:
            decodes = sum(n == 1 for _, n in batch)
            self.t += self.step_cost(sum(n for _, n in batch) - decodes, decodes)
        else:
            self.t += self.step_s if self.step_time is None else self.step_time(sum(n for _, n in batch))
        self.kv.check_integrity()
        return [(s.request_id, n) for s, n in batch]

    def run(self, max_steps: int = 10_000) -> None:
        while self.sched.has_work() and self.steps < max_steps:
            self.step()


def backlogged_window_rates(sim: Sim, tenant: str, window_s: float = 2.0) -> list[float]:
    """Tokens/s served to ``tenant`` in each aligned window it was backlogged all through."""
    rids = [r for r, s in sim.seqs.items() if s.tenant == tenant]
    end_s = max(sim.finished_step[r] for r in rids) * sim.step_s
    served: dict[int, int] = defaultdict(int)
    for t, n in sim.tokens[tenant]:
        served[int(t // window_s)] += n
    return [served[k] / window_s for k in range(int(end_s // window_s))]


# ---- registry ------------------------------------------------------------------------------
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
        assert sim.step() == [("B0", 1), ("B1", 1), ("B2", 1), ("I0", 1)]
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
    [(True, 28, 146, 150), (False, 34, 135, 139)],
)
def test_burst_kvstrata_serves_short_requests_past_the_long_ones(
    same_tenant: bool, short_done_by: int, long_done_by: int, total_steps: int
) -> None:
    """Short prompts that fit pass long ones that do not, and within one tenant the value
    order (pending time over prompt cost) takes the short ones first; aging and the growing
    value of waiting finish every long one (FCFS: 132 steps in all; one tenant here 150, as
    the long prompts run at the end, two at a time, with nothing left to batch beside them)."""
    sim = burst("kvstrata", same_tenant)
    assert last_first_token(sim, "S", 120) == short_done_by  # FCFS: 128
    assert last_first_token(sim, "L", 40) == long_done_by
    assert sim.steps == total_steps
    assert len(sim.finished_step) == 160


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


def floor_under_decodes(policy: str) -> tuple[list[float], int]:
    """Each decode costs 30 ms (a prefill token 2 ms, a step 50 ms). A batch tenant has 15
    long decodes running; a light tenant with a floor of 4 tokens/s starts one 60-token
    decode. Returns the light tenant's tokens/s in each whole 2 s window from its arrival to
    its finish, and the most steps any batch request went without a token meanwhile."""
    tenants = {"bulk": TenantShare("batch", weight=1.0),
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
