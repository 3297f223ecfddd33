"""A tiny step simulator for the bare scheduler (no model, no Ray), with a simulated clock:
it does what the engine does after a forward pass (count computed tokens, cache full blocks,
append one output token per sampled sequence, finish at ``max_tokens``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from cache_node.config import EngineConfig
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.sampling_params import SamplingParams
from cache_node.scheduler import Scheduler
from cache_node.scheduling import SchedulingPolicy, TenantShare, make_policy
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
