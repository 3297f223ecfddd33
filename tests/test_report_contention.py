"""The noisy neighbour's sentence says how much of its share was idle capacity (s39 trial).

A new user's ``kvstrata run deepresearch`` on a loaded host read "The noisy neighbour noisy
offered 4.0x the others' lowest session rate at weight 1 (12% of the total weight) and got 62%
of all output tokens." and took it for weights not enforced. The weights divide a node among
the tenants waiting for it (VTC within a class, classes in order); noisy sent 61% of the calls,
and 60% of its tokens were computed while no other tenant had a call waiting on its node (712
of its 2,475 output tokens after every other tenant's last call had ended). The report now
states that figure (``tokens_while_others_waited``, :mod:`workloads.deepresearch.contention`).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.test_report import _rec
from workloads.deepresearch.config import TenantProfile
from workloads.deepresearch.contention import tokens_while_others_waited
from workloads.deepresearch.findings import what_to_look_at
from workloads.deepresearch.metrics import compute_report

TENANTS = (
    TenantProfile("quiet", "batch", ttft_slo_ms=1000.0, tpot_slo_ms=50.0, min_tokens_per_s=0.0, sessions_per_s=0.05),
    TenantProfile("noisy", "batch", ttft_slo_ms=1000.0, tpot_slo_ms=50.0, min_tokens_per_s=0.0, sessions_per_s=0.2, noisy=True),
)


def _records() -> list[dict[str, Any]]:
    """noisy decodes 10 tokens over [0, 10] s on n0 (no prompt to prefill); quiet's call on n0
    waits [2, 5) for its first token (then 2 tokens over [5, 6]), and its call on n1 waits
    [5, 8), on another node. So 3 of noisy's 10 tokens came while another tenant waited on its
    node."""
    return [
        _rec("noisy", "ok", 0.0, 10.0, node_id="n0", ttft_ms=0.0, completion_tokens=10),
        _rec("quiet", "ok", 2.0, 6.0, node_id="n0", ttft_ms=3000.0, completion_tokens=2),
        _rec("quiet", "ok", 5.0, 9.0, node_id="n1", ttft_ms=3000.0, completion_tokens=1),
        _rec("quiet", "RESOURCE_EXHAUSTED", 0.0, 10.0, node_id="n0"),  # refused: never queued on n0
    ]


def test_tokens_count_only_other_tenants_waits_on_the_same_node() -> None:
    got = tokens_while_others_waited(_records())
    assert got["noisy"] == pytest.approx((10.0, 3.0))
    assert got["quiet"] == pytest.approx((3.0, 0.0))  # noisy never waited (its TTFT is 0)


def test_prefill_counts_as_the_floor_counts_it() -> None:
    """Uncached prompt tokens are spread over [start + queue, first token]: 40 uncached (50
    prompt, 10 cached) over [1, 2] s, while the other tenant waits [1.5, 4)."""
    records = [
        _rec("noisy", "ok", 0.0, 2.0, node_id="n0", ttft_ms=2000.0, queue_ms=1000.0, prompt_tokens=50,
             cached_device_tokens=10, completion_tokens=1),
        _rec("quiet", "ok", 1.5, 5.0, node_id="n0", ttft_ms=2500.0, completion_tokens=1),
    ]
    assert tokens_while_others_waited(records)["noisy"] == pytest.approx((41.0, 21.0))


def test_the_noisy_sentence_says_how_much_came_while_no_one_else_waited() -> None:
    report = compute_report(_records(), [], TENANTS)
    noisy = report["tenants"]["noisy"]
    assert (noisy["tokens"], noisy["tokens_while_others_waited"]) == pytest.approx((10.0, 3.0))
    assert report["overall"]["tokens"] == pytest.approx(13.0)
    sentence = next(line for line in what_to_look_at(report) if line.startswith("The noisy neighbour"))
    assert sentence == (
        "The noisy neighbour noisy offered 4.0x the others' lowest session rate at weight 1 (50% of the "
        "total weight) and got 76% of all output tokens. 70% of its tokens (uncached prefill + output) "
        "were computed while no other tenant had a call waiting on its node: capacity the weights do not "
        "divide (they share a node among the tenants waiting for it)."
    )  # before: the first sentence alone
