"""The global scheduler's routing keys (OpenAI's ``prompt_cache_key``): each tenant keeps its
own bounded share of the keys it remembers a node for (``RoutingKeys``)."""

from __future__ import annotations

from services.global_scheduler import GlobalScheduler
from services.global_scheduler_routing import (
    MAX_ROUTING_KEYS,
    MAX_ROUTING_KEYS_PER_TENANT,
    RoutingKeys,
)
from tenants.model import TenantSpec


def test_one_tenants_keys_do_not_evict_another_tenants_affinity(tmp_path) -> None:
    """Regression (security review F5): all tenants' routing keys shared one LRU of 65,536, so
    one tenant sending 65,536 distinct keys wiped every other tenant's node affinity."""
    sched = GlobalScheduler(str(tmp_path), {"n0": 8, "n1": 8})
    victim, attacker = (sched.register_tenant(TenantSpec(name, "standard"))[0].tenant_id
                        for name in ("victim", "attacker"))
    sched.admit(attacker, "busy")  # n0 is busier: the victim's key names n1
    assert sched.admit(victim, "a", routing_key=f"{victim}/conversation").node_id == "n1"
    sched.release("a", None)
    for k in range(MAX_ROUTING_KEYS + 1):  # the attacker's distinct keys, each on the least loaded n1
        sched.admit(attacker, f"r{k}", routing_key=f"{attacker}/key-{k}")
        sched.release(f"r{k}", None)
    # n1 is now the busier node: the victim's request follows its remembered key there
    sched.admit(attacker, "busy-n1", routing_key=f"{attacker}/key-{MAX_ROUTING_KEYS}")
    sched.admit(attacker, "busy-n1b", routing_key=f"{attacker}/key-{MAX_ROUTING_KEYS}")
    assert sched.admit(victim, "b", routing_key=f"{victim}/conversation").node_id == "n1"
    assert len(sched.routing_keys) <= MAX_ROUTING_KEYS
    assert len(sched.routing_keys.by_tenant[attacker]) == MAX_ROUTING_KEYS_PER_TENANT


def test_the_total_bound_evicts_from_the_tenant_holding_the_most() -> None:
    keys = RoutingKeys(per_tenant=4, total=6)
    for k in range(4):
        keys.put("big", f"b{k}", "n0")
    keys.put("small", "s0", "n1")
    keys.put("small", "s1", "n1")
    keys.put("third", "t0", "n0")  # 7 > 6: the oldest of "big" goes
    assert len(keys) == 6 and keys.get("big", "b0") is None and keys.get("big", "b1") == "n0"
    assert keys.get("small", "s0") == "n1" and keys.get("third", "t0") == "n0"
    keys.put("big", "b1", "n1")  # used again: now big's newest
    keys.put("big", "b4", "n0")  # big's own cap and the total: its oldest (b2) goes
    assert keys.get("big", "b2") is None and keys.get("big", "b1") == "n1" and len(keys) == 6
    assert keys.get("nobody", "x") is None
