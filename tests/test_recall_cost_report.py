"""bench.recall_cost's report: TPOT medians, ratios to the full cache and issue 22's target."""

from __future__ import annotations

from bench.recall_cost import TARGET_SPEC, report


def test_report_checks_the_tpot_target_on_medians() -> None:
    tpot = {"full": {"tpot": [0.060, 0.064, 0.080], "cpu": [0.06, 0.06, 0.06]},
            TARGET_SPEC: {"tpot": [0.070, 0.090, 0.075], "cpu": [0.07, 0.07, 0.07]},
            "sentencekv-0.25": {"tpot": [0.1, 0.1, 0.1], "cpu": [0.1, 0.1, 0.1]}}
    out = report(tpot, [])
    assert out["tpot"]["full"]["ratio_to_full"] == 1.0
    assert out["tpot"][TARGET_SPEC]["ratio_to_full"] == round(0.075 / 0.064, 3)
    assert out["target"]["holds"] and out["target"]["ratio"] == round(0.075 / 0.064, 3)
    tpot[TARGET_SPEC]["tpot"] = [0.1, 0.1, 0.1]
    assert not report(tpot, [])["target"]["holds"]


def test_no_target_without_both_policies() -> None:
    assert "target" not in report({"full": {"tpot": [0.06], "cpu": [0.06]}}, [])
