"""Global admission with TTFT estimates (plain GlobalScheduler, no Ray started)."""

from __future__ import annotations

import pytest

from services.config import ServiceConfig
from services.global_scheduler import GlobalScheduler
from tenants.model import TenantSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def scheduler(tmp_path, policy: str) -> tuple[GlobalScheduler, dict[str, str], Clock]:
    clock = Clock()
    gs = GlobalScheduler(str(tmp_path), {"n0": 4}, queue_limit=1000, scheduler=policy, clock=clock)
    ids = {}
    for name, cls in (("live", "interactive"), ("bulk", "batch"), ("std", "standard")):
        tenant, key = gs.register_tenant(TenantSpec(name, cls))  # live: 1000 ms, std: 5000 ms
        gs.authenticate(key)
        ids[name] = tenant.tenant_id
    gs.nodes["n0"].prefill.set(1000.0)  # tokens/s, as a node reports on release
    gs.nodes["n0"].step_s.update(0.05)
    return gs, ids, clock


def test_interactive_rejected_early_with_retry_hint_when_slo_cannot_be_met(tmp_path) -> None:
    gs, ids, clock = scheduler(tmp_path, "kvstrata")
    # an interactive request waits half a step (0.05 s prior) before its own isolated prefill
    assert gs.admit(ids["live"], "a", prompt_tokens=900).code == "OK"  # 0.9 s + 0.025 s
    rej = gs.admit(ids["live"], "b", prompt_tokens=200)  # 900 ahead + 200: 1.125 s > 1 s
    assert rej.code == "RESOURCE_EXHAUSTED"
    assert rej.retry_after_s == pytest.approx(0.125)
    assert gs.admit(ids["bulk"], "c", prompt_tokens=50_000).code == "OK"  # batch queues
    assert gs.admit(ids["std"], "d", prompt_tokens=5000).code == "OK"  # 5.95 s < 2 x 5 s
    clock.t += 0.5  # 500 tokens of the interactive backlog drained; batch does not count
    assert gs.admit(ids["live"], "e", prompt_tokens=200).code == "OK"  # 400 + 200: 0.625 s
    assert gs.usage_of(ids["live"]).rejected == 1


def test_fcfs_admission_never_rejects_on_estimates(tmp_path) -> None:
    gs, ids, _ = scheduler(tmp_path, "fcfs")
    assert [gs.admit(ids["live"], f"r{i}", prompt_tokens=5000).code for i in range(3)] == ["OK"] * 3


def test_release_takes_the_node_measured_prefill_speed(tmp_path) -> None:
    gs, ids, _ = scheduler(tmp_path, "kvstrata")
    gs.admit(ids["live"], "a", prompt_tokens=10)
    gs.release("a", {"completion_tokens": 3, "prefill_tokens_per_s": 250.0, "step_s": 0.2})
    assert gs.nodes["n0"].prefill.tokens_per_s == 250.0
    assert gs.stats()["prefill_tokens_per_s"] == {"n0": 250.0}


def test_service_config_scheduler_names_are_checked() -> None:
    assert ServiceConfig(scheduler="kvstrata").scheduler == "kvstrata"
    with pytest.raises(ValueError, match="known: \\['fcfs', 'kvstrata', 'priority', 'vtc'\\]"):
        ServiceConfig(scheduler="edf")


def test_step_model_fits_steps_held_at_one_bound() -> None:
    """Regression (issue 21): steps held at a 0.25 s bound all cost about the same; the line
    through (60 tokens, 0.248 s) and (59 tokens, 0.249 s) has a negative slope, the fit was
    refused, ``step_budget`` returned None and the scheduler ran an unbounded 1.8 s step while
    an interactive tenant was active. Such steps now fall back to one cost per token."""
    from cache_node.scheduling.admission import StepTimeModel

    model = StepTimeModel()
    for i in range(64):
        model.observe(*((56, 4, 0.248) if i % 7 else (54, 5, 0.249)))
    base, per_token, per_decode = model.fit()
    assert base == 0.0 and per_token == per_decode == pytest.approx(0.248 / 60, rel=0.01)
    decodes, prefill = model.step_budget(0.25, decodes=4, least_decodes=0, cap=512)
    assert decodes == 4 and 50 <= prefill <= 60
