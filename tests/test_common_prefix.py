"""The scheduler's common-prefix statistic (``services.block_index.CommonPrefix``): one window
per tenant and namespace, bounded in groups and prompts (plain GlobalScheduler, no Ray)."""

from __future__ import annotations

from pathlib import Path

from cache_node.hashing import hash_prompt_blocks
from services.block_index import CommonPrefix
from services.global_scheduler import GlobalScheduler
from tests.known_tenants import know_tenants
from tests.test_spill_store import hashes_of

BS = 16
SYSTEM = list(range(1000, 1000 + 20 * BS))  # alice's 20-block system prompt


def prompt(namespace: str, head: list[int], i: int) -> list[bytes]:
    """Chained hashes of ``head`` and two blocks of its own, as the gateway computes them."""
    return hash_prompt_blocks(head + [7000 + i] * 2 * BS, BS, (namespace, "m", "fp16"))


def route_twenty(gs: GlobalScheduler, label: str) -> dict[str, int]:
    """Where 20 of alice's requests sharing her system prompt go, each kept in flight."""
    picks = [gs.admit("alice", f"{label}{i}", block_hashes=prompt("alice", SYSTEM, 10_000 + i)).node_id
             for i in range(20)]
    for i in range(20):
        gs.release(f"{label}{i}", None)
    return {"n1": picks.count("n1"), "n2": picks.count("n2")}


def test_another_tenants_prompts_leave_a_tenants_common_prefix(tmp_path: Path) -> None:
    """Regression (security review secrev20 S3): one window of the last 256 prompts served
    every tenant, so mallory's 256 prompts pushed alice's out; her common prefix fell from 20
    blocks to 0, the 20-block system prompt n1 holds became a match past it, and all 20 of her
    requests went to n1 (10/10 before). Nor may mallory's prompts in 1,000 namespaces of their
    own (one ``cache_salt`` each) push alice's window out."""
    gs = know_tenants(GlobalScheduler(str(tmp_path), {"n1": 64, "n2": 64}), "alice", "mallory")
    gs.report_events("n1", [("stored", h, "device") for h in prompt("alice", SYSTEM, 0)[:20]])
    for i in range(100):
        gs.admit("alice", f"a{i}", block_hashes=prompt("alice", SYSTEM, i))
        gs.release(f"a{i}", None)
    assert route_twenty(gs, "before") == {"n1": 10, "n2": 10}
    for i in range(256):
        gs.admit("mallory", f"m{i}", block_hashes=prompt("mallory", [5] * BS, i))
        gs.release(f"m{i}", None)
    for i in range(1000):
        gs.admit("mallory", f"s{i}", block_hashes=prompt(f"mallory#salt={i}", [5] * BS, i))
        gs.release(f"s{i}", None)
    assert route_twenty(gs, "after") == {"n1": 10, "n2": 10}
    assert gs.common_prefix.blocks_for(prompt("alice", SYSTEM, 0), "alice") == 20
    gs.common_prefix.check_integrity()


def test_windows_are_bounded_and_the_heaviest_tenant_gives_up_prompts() -> None:
    """A tenant keeps windows for its ``groups_per_tenant`` newest namespaces; past
    ``max_prompts`` in all, the tenant keeping the most gives up the oldest prompts of its
    least recently observed window; a deleted tenant's windows go."""
    cp = CommonPrefix(window=8, min_prompts=4, refresh=1, groups_per_tenant=2, max_prompts=16)
    g1, g2, g3, gb, gb2 = (hashes_of(range(10 * k, 10 * k + 3)) for k in range(5))
    for group in (g1, g2):
        for _ in range(8):
            cp.observe(group, "a")
    assert (cp.blocks_for(g1, "a"), cp.blocks_for(g2, "a"), cp.prompts) == (3, 3, 16)
    cp.observe(g3, "a")  # a third namespace: g1's window, the least recently observed, goes
    assert (cp.blocks_for(g1, "a"), cp.blocks_for(g2, "a"), cp.prompts) == (0, 3, 9)
    for _ in range(8):
        cp.observe(gb, "b")  # the 8th passes 16 prompts: a keeps 9, the most, and gives one up
    assert (cp._kept["a"], cp._kept["b"], cp.prompts) == (8, 8, 16)
    assert [len(w.prompts) for w in cp._groups["a"].values()] == [7, 1]  # g2 gave it up
    for _ in range(8):
        cp.observe(gb2, "b")  # b's own windows trade places; a keeps its 8
    assert (cp._kept["a"], cp._kept["b"], cp.prompts) == (8, 8, 16)
    assert [len(w.prompts) for w in cp._groups["b"].values()] == [8]  # gb emptied and went
    assert (cp.blocks_for(g2, "a"), cp.blocks_for(gb2, "b"), cp.blocks_for(gb2, "a")) == (3, 3, 0)
    cp.check_integrity()
    cp.forget("b")
    assert (cp.prompts, cp.blocks_for(gb2, "b"), list(cp._groups)) == (8, 0, ["a"])
    cp.check_integrity()
