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


FINISHED = {"type": "finished", "finish_reason": "stop", "prompt_tokens": 100, "completion_tokens": 5,
            "prefill_tokens_per_s": 1000.0, "step_s": 0.05, "queue_ms": 1.0}


def _gateway_takes(adm) -> None:
    """Raises ``data_plane.BadReply`` when the gateway refuses ``adm`` as a malformed reply."""
    import dataclasses

    from services import data_plane

    data_plane.admission_reply({"id": 1, "adm": dataclasses.asdict(adm)}, {"n0"})


@pytest.mark.parametrize("bad", [
    {"prefill_tokens_per_s": 0.0}, {"prefill_tokens_per_s": -5.0}, {"prefill_tokens_per_s": True},
    {"prefill_tokens_per_s": "900"}, {"prefill_tokens_per_s": float("inf")},
    {"step_s": 0.0}, {"step_s": float("nan")}, {"step_s": False},
])
def test_a_nodes_speeds_that_are_no_positive_numbers_are_ignored_and_counted(tmp_path, bad) -> None:
    """Regression (review 25a E): a node's finished event (which the gateway checks only for
    finite values >= 0) set the node's prefill speed as it came: 1e-300 tokens/s made the next
    refusal's ``retry_after_s`` 8e302, which the gateway refused as a malformed admission reply
    (UNAVAILABLE, no hint), and the backlog never drained again."""
    gs, ids, clock = scheduler(tmp_path, "kvstrata")
    assert gs.admit(ids["live"], "r1", prompt_tokens=800).code == "OK"
    gs.release("r1", FINISHED | bad)
    clock.t += 1.0  # the backlog drained
    assert gs.admit(ids["live"], "r2", prompt_tokens=800).code == "OK"
    adm = gs.admit(ids["live"], "r3", prompt_tokens=800)
    _gateway_takes(adm)
    assert (adm.code, adm.retry_after_s) == ("RESOURCE_EXHAUSTED", pytest.approx(0.625))
    assert (gs.nodes["n0"].prefill.tokens_per_s, gs.nodes["n0"].step_s.value) == (1000.0, 0.05)
    name, = bad
    assert gs.stats()["ignored_speeds"] == {name: 1}


@pytest.mark.parametrize(("reported", "taken"), [
    ({"prefill_tokens_per_s": 1e-300}, (1.0, 0.05)), ({"prefill_tokens_per_s": 0.5}, (1.0, 0.05)),
    ({"prefill_tokens_per_s": 1.2e7}, (1e7, 0.05)), ({"prefill_tokens_per_s": 1e12}, (1e7, 0.05)),
    ({"step_s": 1e9}, (1000.0, 12.04)),  # 60 s into the step-time average (0.05 s before)
])
def test_a_nodes_speeds_past_their_range_are_taken_at_its_end(tmp_path, reported, taken) -> None:
    """Review 25c (5): a speed past its range was ignored, so an honest node prefilling 1.2e7
    tokens/s (a tiny model on a fast GPU) kept the 1,000 tokens/s prior and its interactive
    admissions were refused ``ttft_estimate``. A positive speed is now taken at the range's
    nearer end, and every refusal it leads to is one the gateway takes (1e-300 tokens/s, the
    review 25a E case, is a 1 token/s node: a day's hint at most)."""
    gs, ids, clock = scheduler(tmp_path, "kvstrata")
    assert gs.admit(ids["live"], "r1", prompt_tokens=800).code == "OK"
    gs.release("r1", FINISHED | reported)
    assert (gs.nodes["n0"].prefill.tokens_per_s, gs.nodes["n0"].step_s.value) == pytest.approx(taken)
    assert gs.stats()["ignored_speeds"] == {}
    clock.t += 1.0
    for i in range(3):
        adm = gs.admit(ids["live"], f"q{i}", prompt_tokens=2000)
        _gateway_takes(adm)
    if taken[0] == 1e7:  # the fast node admits what the prior would have refused
        assert gs.admit(ids["live"], "fast", prompt_tokens=2000).code == "OK"


def test_a_slow_nodes_deep_backlog_gives_a_hint_the_gateway_takes(tmp_path) -> None:
    """An honest slow node (2 tokens/s, its lowest sane speed is 1) behind a deep batch backlog:
    the hint is capped at ``MAX_RETRY_AFTER_S`` (a day), never a reply the gateway refuses."""
    from services.data_plane import MAX_RETRY_AFTER_S

    gs, ids, _ = scheduler(tmp_path, "kvstrata")
    gs.nodes["n0"].prefill.set(2.0)
    gs.nodes["n0"].backlog.add(0, ids["live"], 10_000_000.0, 4.0)  # its own: ~58 days at 2/s
    adm = gs.admit(ids["live"], "r1", prompt_tokens=10)
    assert (adm.code, adm.retry_after_s) == ("RESOURCE_EXHAUSTED", MAX_RETRY_AFTER_S)
    _gateway_takes(adm)
