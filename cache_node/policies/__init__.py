"""KV compression and semantic tiering policies, one small class per file, behind a registry.

Select per request with ``LLMEngine.add_request(..., policy="snapkv-0.25")`` (or a tenant's
default ``policy``); see ``registry`` for the spec grammar.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cache_node.block_pool import BlockPool
from cache_node.kv_pool import KVPool
from cache_node.kv_state import SequenceKV
from cache_node.policies import (  # noqa: F401 (each module registers its policy)
    full,
    gkv,
    h2o,
    quant,
    sentencekv,
    snapkv,
    spindlekv,
    streaming,
)
from cache_node.policies.base import LayerPlan, LayerView, Policy, PolicyEnv
from cache_node.policies.registry import (
    REGISTRY,
    get_policy_class,
    known_policies,
    make_policy,
    parse_spec,
)
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.tiers.manager import TierManager

__all__ = [
    "REGISTRY", "LayerPlan", "LayerView", "Policy", "PolicyEnv", "attach_policy",
    "get_policy_class", "known_policies", "make_policy", "parse_spec",
]


def attach_policy(
    seq: Sequence, pool: KVPool, block_pool: BlockPool, env: PolicyEnv | None = None,
    host: TierManager | None = None,
) -> None:
    """Give ``seq`` the per-sequence state its ``seq.policy`` spec needs (none for "" / full).

    Raises:
        ValueError: unknown policy or malformed spec (the message lists the known policies).
    """
    if not seq.policy:
        return
    policy = make_policy(seq.policy)
    if policy.compresses:
        seq.kv = SequenceKV(seq, policy, pool, block_pool, env, host)
