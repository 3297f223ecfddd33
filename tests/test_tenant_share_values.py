"""A tenant share (``TenantShare``) holds finite values only; a data-plane request whose
``extra`` carries NaN or infinity is refused alone, and its tenant's share on the node is
left as it was."""

from __future__ import annotations

import asyncio
import math

import pytest

from cache_node.sampling_params import SamplingParams
from cache_node.scheduling import TenantShare
from services.cache_node import CacheNode
from services.config import NodeConfig
from services.node_request import NodeRequest

PROMPT = (1, 504, 3575, 28, 614, 1242, 314, 216, 1241, 2406, 30, 2)
SHARE = {"slo_class": "interactive", "ttft_slo_ms": "2000", "min_tokens_per_s": "10", "weight": "2"}


@pytest.mark.parametrize("field", ["ttft_slo_ms", "min_tokens_per_s", "weight", "kv_quota_blocks"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_share_refuses_values_that_are_not_finite(field: str, value: float) -> None:
    """Regression (security review F6): ``TenantShare('standard', inf, nan, inf, 0)`` was
    accepted (``weight > 0`` holds for infinity, ``min_tokens_per_s < 0`` fails for NaN)."""
    with pytest.raises(ValueError, match="finite"):
        TenantShare(**{"slo_class": "standard", field: value})


def test_a_data_plane_request_with_a_share_that_is_not_finite_is_refused_alone() -> None:
    """Regression (security review F6): a data-plane message's ``extra`` with "nan" or "inf"
    set a NaN floor or an infinite weight for its tenant on the node (every tenant's
    scheduling there); now that request is refused INVALID_ARGUMENT, the share stays as it
    was and the next request runs."""
    node = CacheNode("t", NodeConfig(kv_pool_bytes=16 << 20, host_bytes=0), num_threads=1)

    def request(rid: str, **extra: str) -> NodeRequest:
        return NodeRequest(request_id=rid, tenant="acme", cache_namespace="ns", token_ids=PROMPT,
                           sampling=SamplingParams(max_tokens=2, ignore_eos=True), extra={**SHARE, **extra})

    async def run(req: NodeRequest) -> list[dict]:
        return [ev async for ev in node.generate(req)]

    try:
        assert asyncio.run(run(request("ok")))[-1]["type"] == "finished"
        policy = node.engine.scheduler.policy
        before = policy.tenants["acme"]
        for k, bad in enumerate([{"weight": "inf"}, {"min_tokens_per_s": "nan"}, {"ttft_slo_ms": "1e999"}]):
            events = asyncio.run(run(request(f"bad{k}", **bad)))
            assert [(ev["type"], ev["code"]) for ev in events] == [("error", "INVALID_ARGUMENT")], events
            assert "finite" in events[0]["message"]
            assert policy.tenants["acme"] == before
        assert asyncio.run(run(request("after")))[-1]["type"] == "finished"
    finally:
        node.shutdown()
