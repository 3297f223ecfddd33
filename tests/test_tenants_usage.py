"""UsageLedger and TierTokens: exact counters, validation, snapshots."""

from __future__ import annotations

import pytest

from tenants.usage import TenantUsage, TierTokens, UsageLedger


def test_tier_tokens_from_dict_total_and_add() -> None:
    a = TierTokens.from_dict({"device": 32, "spill_disk": 16})
    b = TierTokens(device=1, host=2, spill_ram=3, spill_disk=4)

    assert a == TierTokens(device=32, host=0, spill_ram=0, spill_disk=16)
    assert (a.total, b.total) == (48, 10)
    assert (a + b).as_dict() == {"device": 33, "host": 2, "spill_ram": 3, "spill_disk": 20}


def test_tier_tokens_validation() -> None:
    with pytest.raises(ValueError) as excinfo:
        TierTokens.from_dict({"device": 1, "gpu": 2})
    assert str(excinfo.value) == (
        "unknown tiers ['gpu']; known tiers: ['device', 'host', 'spill_ram', 'spill_disk']"
    )
    with pytest.raises(ValueError, match="^host must be a non-negative integer, got -1$"):
        TierTokens(host=-1)
    with pytest.raises(ValueError, match="^spill_ram must be a non-negative integer, got 1.0$"):
        TierTokens.from_dict({"spill_ram": 1.0})  # type: ignore[dict-item]


def test_ledger_counts_exactly() -> None:
    ledger = UsageLedger()
    ledger.record_request("t1", prompt_tokens=100, cached_tokens={"device": 64, "host": 16})
    ledger.record_request("t1", prompt_tokens=50, cached_tokens=TierTokens(spill_disk=32))
    ledger.record_completion_tokens("t1", 7)
    ledger.record_completion_tokens("t1", 13)
    ledger.record_rejected("t1")
    ledger.record_preempted("t1")
    ledger.record_preempted("t1")
    ledger.set_blocks_held("t1", 12)
    ledger.set_blocks_held("t1", 9)
    ledger.record_rejected("t2")

    assert ledger.snapshot("t1") == TenantUsage(
        tenant_id="t1",
        prompt_tokens=150,
        completion_tokens=20,
        cached_tokens=TierTokens(device=64, host=16, spill_ram=0, spill_disk=32),
        blocks_held=9,
        requests=2,
        rejected=1,
        preempted=2,
    )
    assert ledger.snapshot_all() == {
        "t1": ledger.snapshot("t1"),
        "t2": TenantUsage("t2", rejected=1),
    }


def test_prompt_recorded_at_release_adds_without_counting_a_request() -> None:
    ledger = UsageLedger()
    ledger.record_request("t1")
    ledger.record_prompt("t1", prompt_tokens=59, cached_tokens={"device": 44})
    ledger.record_prompt("t1", prompt_tokens=10, cached_tokens={"host": 4, "spill_ram": 2})
    u = ledger.snapshot("t1")
    assert (u.requests, u.prompt_tokens) == (1, 69)
    assert u.cached_tokens == TierTokens(device=44, host=4, spill_ram=2)
    with pytest.raises(ValueError, match="exceeds prompt_tokens"):
        ledger.record_prompt("t1", prompt_tokens=3, cached_tokens={"device": 4})
    assert ledger.snapshot("t1") == u


def test_unknown_tenant_snapshot_is_zero_and_forget() -> None:
    ledger = UsageLedger()
    assert ledger.snapshot("new") == TenantUsage("new")
    assert ledger.snapshot_all() == {}

    ledger.record_request("new", prompt_tokens=4)
    ledger.forget("new")
    ledger.forget("never-seen")

    assert ledger.snapshot_all() == {}


def test_invalid_records_change_nothing() -> None:
    ledger = UsageLedger()
    ledger.record_request("t", prompt_tokens=10)

    with pytest.raises(ValueError, match="^cached_tokens total 12 exceeds prompt_tokens 10$"):
        ledger.record_request("t", prompt_tokens=10, cached_tokens={"device": 12})
    with pytest.raises(ValueError, match="^prompt_tokens must be a non-negative integer, got -1$"):
        ledger.record_request("t", prompt_tokens=-1)
    with pytest.raises(ValueError, match="^tokens must be a non-negative integer, got 2.5$"):
        ledger.record_completion_tokens("t", 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^blocks must be a non-negative integer, got True$"):
        ledger.set_blocks_held("t", True)
    with pytest.raises(ValueError, match="^tenant_id must be a non-empty string, got ''$"):
        ledger.record_rejected("")

    assert ledger.snapshot_all() == {"t": TenantUsage("t", prompt_tokens=10, requests=1)}
