"""The tier-aware global block index (plain GlobalScheduler and SpillNode, no Ray started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cache_node.tiers.manager import TIERS
from services.block_index import TIERS as INDEX_TIERS
from services.block_index import BlockIndex, PrefixTiers
from services.global_scheduler import GlobalScheduler, IndexHolders
from services.spill_node import SpillNode
from tenants.model import TenantSpec
from tests.known_tenants import know_tenants
from tests.test_slo_admission import Clock
from tests.test_spill_store import BLOCK, DISK, FMT, hashes_of, make_blocks

H = hashes_of(range(12))  # a chain of block hashes, as the gateway computes them


def by_tier(**counts: int) -> dict[str, int]:
    return {"device": 0, "host": 0, "spill_ram": 0, "spill_disk": 0} | counts


def stored(tier: str, hashes: list[bytes]) -> list[tuple[str, bytes, str]]:
    return [("stored", h, tier) for h in hashes]


def removed(tier: str, hashes: list[bytes]) -> list[tuple[str, bytes, str]]:
    return [("removed", h, tier) for h in hashes]


SPILL_NODES = IndexHolders(spill_blocks=dict.fromkeys(("spill_node_0", "spill_node_1", "s0"), 1000))


def plain(tmp_path: Path, nodes: tuple[str, ...] = ("n0", "n1"), **kw: object) -> GlobalScheduler:
    """A scheduler with these tests' tenants ("t", "noisy", "quiet", "third", "mallory", "alice")
    and spill nodes ("spill_node_0", "spill_node_1", "s0")."""
    kw.setdefault("holders", SPILL_NODES)
    gs = GlobalScheduler(str(tmp_path), dict.fromkeys(nodes, 4), **kw)  # type: ignore[arg-type]
    return know_tenants(gs, "t", "noisy", "quiet", "third", "mallory", "alice")


def test_index_tiers_are_the_cache_nodes_tier_names() -> None:
    assert INDEX_TIERS == TIERS


def test_demotion_moves_a_hash_from_device_to_host(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[:3]))
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=3)
    gs.report_events("n0", removed("device", H[:2]) + stored("host", H[:2]))  # engine order
    assert gs.index.holders(H[0]) == {("n0", "host")}
    assert gs.index.holders(H[2]) == {("n0", "device")}
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=1, host=2)
    assert gs.stats()["indexed_blocks"] == 3
    gs.index.check_integrity()


def test_promotion_keeps_the_device_copy_whatever_the_event_order(tmp_path) -> None:
    """Regression guard: a node's batch lists device events before host events, so a
    promotion reads stored/device then removed/host; an index keyed by holder alone would
    drop the device copy on the host removal."""
    gs = plain(tmp_path)
    gs.report_events("n0", stored("host", H[:2]))
    gs.report_events("n0", stored("device", H[:2]) + removed("host", H[:2]))
    assert [gs.index.holders(h) for h in H[:2]] == [{("n0", "device")}] * 2
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=2)


def test_two_tuples_are_device_events(tmp_path) -> None:
    gs = plain(tmp_path)
    assert gs.report_events("n1", [("stored", H[0]), ("stored", H[1])]) == 2
    gs.report_events("n1", [("removed", H[1])])
    assert gs.index.holders(H[0]) == {("n1", "device")} and gs.index.holders(H[1]) == set()


def test_spill_events_add_spill_holders_and_removal_cleans_up(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[:2]))
    gs.report_events("spill_node_0", stored("spill_ram", H[:4]))
    gs.report_events("spill_node_0", removed("spill_ram", H[:4]) + stored("spill_disk", H[:4]))
    assert gs.index.holders(H[0]) == {("n0", "device"), ("spill_node_0", "spill_disk")}
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=2, spill_disk=4)
    gs.report_events("spill_node_0", removed("spill_disk", H[:4]))
    gs.report_events("n0", removed("device", H[:2]))
    assert len(gs.index) == 0 and gs.stats()["indexed_blocks_by_tier"] == by_tier()
    gs.index.check_integrity()


def test_removing_what_is_not_held_is_a_no_op(tmp_path) -> None:
    """Events of a flush may arrive after ``flush_index`` cleared everything."""
    gs = plain(tmp_path)
    gs.report_events("n0", stored("host", H[:1]))
    gs.report_events("n0", removed("device", H[:1]) + removed("host", H[1:2]))
    assert gs.index.holders(H[0]) == {("n0", "host")}
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(host=1)


def test_reset_forgets_what_a_restarted_holder_held(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("spill_node_0", stored("spill_ram", H[:3]) + stored("spill_disk", H[3:5]))
    gs.report_events("spill_node_1", stored("spill_ram", H[5:6]))
    gs.report_events("spill_node_0", stored("spill_disk", H[3:4]), reset=True)  # rebuilt disk
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(spill_ram=1, spill_disk=1)
    assert len(gs.index) == 2
    gs.index.check_integrity()


@pytest.mark.parametrize("holder, events", [
    ("n0", stored("device", H[:1]) + stored("gpu", H[1:2])),
    ("n0", [("evicted", H[0], "device")]),
    ("n0", [("stored", "ab", "device")]),
    ("n0", [("stored", b"", "device")]),
    ("n0", [("stored", b"x" * 65, "device")]),  # a hash past MAX_HASH_BYTES (the review's was 16 MiB)
    ("n0", stored("device", H[:1]) + stored("spill_disk", H[1:2])),  # a cache node holds no spill tier
    ("s0", [("stored", H[0])]),  # (event, hash): tier device, no spill node's
    ("s0", stored("host", H[:1])),
    ("n0", [("stored", H[0], "device", "extra")]),
    ("n0", [["stored"]]),
    ("n0", "stored"),
    ("n0", {"stored": H[0]}),
])
def test_bad_events_are_refused_whole_counted_and_never_raise(tmp_path, holder, events) -> None:
    """A batch is untrusted input, checked whole as a restarted scheduler checks a report
    (``recovery_report.block_changes``): a bad one applies nothing, returns 0 and is counted;
    it never raises (a holder calls fire-and-forget).

    Regression (review 25a D): a 16 MiB hash was stored, a cache node could report spill tiers."""
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[5:7]))
    gs.report_events("s0", stored("spill_ram", H[8:9]))
    assert gs.report_events(holder, events) == 0  # type: ignore[arg-type]
    assert gs.report_events(holder, events, reset=True) == 0  # type: ignore[arg-type]
    assert gs.stats()["refused_block_reports"] == {"malformed": 2}
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=2, spill_ram=1)
    gs.index.check_integrity()


def test_only_known_holders_report(tmp_path) -> None:
    """Regression (review 25a D): any holder id was taken, so any caller could add a holder
    (each one more set of entries, unbounded) or reset one that is no holder here. Only the
    scheduler's cache nodes and its spill nodes (``IndexHolders.spill_blocks``) report."""
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[:4]))
    for holder in ("no-such-holder", "", "spill_node_9", None, ("n0",), b"n0"):
        assert gs.report_events(holder, stored("spill_disk", H[4:5])) == 0  # type: ignore[arg-type]
        assert gs.report_events(holder, stored("device", H[4:5]), reset=True) == 0  # type: ignore[arg-type]
    assert gs.stats()["refused_block_reports"] == {"unknown_holder": 12}
    assert gs.index.node_prefix("n0", H) == 4 and len(gs.index) == 4
    assert gs.report_events("spill_node_1", stored("spill_disk", H[4:5])) == 1  # a known spill node


def test_a_holder_holds_at_most_its_capacity(tmp_path) -> None:
    """Regression (review 25a D): nothing bounded what one holder reported (one call added
    4,194,305 hashes, +2.2 GB); a holder that never reported removals grew the index without
    end. A batch after which its holder would hold more pairs than its capacity is refused
    whole; moves between its tiers, in either event order, pass at capacity."""
    gs = plain(tmp_path, holders=IndexHolders(node_blocks=4, spill_blocks={"s0": 3}))
    assert gs.report_events("n0", stored("device", H[:4])) == 4
    assert gs.report_events("n0", stored("device", H[4:5])) == 0  # a 5th block
    assert gs.report_events("n0", removed("device", H[:2]) + stored("host", H[:2])) == 4  # demotion
    assert gs.report_events("n0", stored("device", H[:1]) + removed("host", H[:1])) == 2  # promotion
    assert gs.report_events("n0", removed("device", H[3:4]) + stored("device", H[4:5])) == 2  # a swap
    assert gs.report_events("n0", stored("device", H[4:9]), reset=True) == 0  # 5 after a reset
    assert gs.report_events("n0", stored("host", H[5:9]), reset=True) == 4  # 4 after a reset
    assert gs.report_events("n1", stored("device", H[:4])) == 4  # each cache node its own
    assert gs.report_events("s0", stored("spill_ram", H[:2]) + stored("spill_disk", H[:2])) == 0  # 4 pairs
    assert gs.report_events("s0", stored("spill_ram", H[:2]) + stored("spill_disk", H[:1])) == 3
    assert gs.stats()["refused_block_reports"] == {"over_capacity": 3}
    assert (gs.index.pairs_of("n0"), gs.index.pairs_of("n1"), gs.index.pairs_of("s0")) == (4, 4, 3)
    gs.index.check_integrity()


def test_a_restarted_nodes_old_blocks_do_not_count_against_its_capacity(tmp_path) -> None:
    """A node restarted between two health polls (``node_up`` from a new process, no
    ``node_down``): its old process's blocks are forgotten, else they would hold its capacity
    and every report of the new process be refused for good. The same process back keeps them."""
    gs = plain(tmp_path, holders=IndexHolders(node_blocks=4))
    gs.attach_nodes({"n0": "tcp://n0:1", "n1": "tcp://n1:1"}, _Recorder())
    gs.node_up("n0", "tcp://n0:1", pid=10, restarts=0)
    assert gs.report_events("n0", stored("device", H[:4])) == 4
    gs.node_up("n0", "tcp://n0:1", pid=10, restarts=0)  # it missed a poll: the same process
    assert gs.index.node_prefix("n0", H) == 4
    gs.node_up("n0", "tcp://n0:2", pid=11, restarts=1)  # a new process
    assert gs.index.pairs_of("n0") == 0
    assert gs.report_events("n0", stored("device", H[4:8])) == 4
    assert gs.stats()["refused_block_reports"] == {}


def test_a_batch_past_the_report_limit_is_refused(tmp_path, monkeypatch) -> None:
    """At most ``MAX_REPORTED_BLOCKS`` events a batch, as a restarted scheduler takes from one
    report (the review's batch was 4,194,305 events; here the limit is made 8)."""
    import services.recovery_report

    monkeypatch.setattr(services.recovery_report, "MAX_REPORTED_BLOCKS", 8)
    gs = plain(tmp_path)
    assert gs.report_events("n0", stored("device", H[:4]) + removed("device", H[:4])) == 8
    assert gs.report_events("n0", stored("device", H[:5]) + removed("device", H[:4])) == 0
    assert gs.stats()["refused_block_reports"] == {"malformed": 1} and len(gs.index) == 0


def test_pairs_after_predicts_what_apply_leaves() -> None:
    """``BlockIndex.pairs_after`` (the capacity check) agrees with applying, in any order of
    stores and removals over two tiers, with and without a reset."""
    import random

    rng = random.Random(25)
    index = BlockIndex()
    for _ in range(300):
        batch = [(rng.choice(("stored", "removed")), H[rng.randrange(6)], rng.choice(("device", "host")))
                 for _ in range(rng.randrange(12))]
        reset = rng.random() < 0.1
        predicted = index.pairs_after("n0", batch, reset)
        if reset:
            index.forget("n0")
        index.apply("n0", batch)
        assert index.pairs_of("n0") == predicted
        index.check_integrity()


def test_flush_clears_every_tier(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[:2]) + stored("host", H[2:4]))
    gs.report_events("spill_node_0", stored("spill_ram", H[4:5]) + stored("spill_disk", H[5:6]))
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(device=2, host=2, spill_ram=1, spill_disk=1)
    gs.flush_index()
    assert gs.stats()["indexed_blocks"] == 0 and gs.stats()["indexed_blocks_by_tier"] == by_tier()
    json.dumps(gs.stats())  # the gateway's Stats ships it as JSON


def test_routing_prefers_the_longer_device_plus_host_prefix(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("n0", stored("device", H[:5]))
    gs.report_events("n1", stored("device", H[:3]) + stored("host", H[3:6]))
    assert gs.admit("t", "r1", block_hashes=H).node_id == "n1"  # 6 blocks (3 in host) > 5
    gs.report_events("n1", removed("host", H[3:6]))  # spilled: a spill node reports them
    assert gs.report_events("spill_node_0", stored("spill_ram", H[3:6])) == 3
    assert gs.admit("t", "r2", block_hashes=H).node_id == "n0"  # n1 keeps 3 of its own


def test_spill_blocks_favour_no_node(tmp_path) -> None:
    gs = plain(tmp_path)
    gs.report_events("spill_node_0", stored("spill_ram", H))
    gs.admit("t", "busy", block_hashes=[])  # n0 now has one request in flight
    adm = gs.admit("t", "r", block_hashes=H)
    assert (adm.node_id, adm.spill_blocks) == ("n1", 12)  # the least loaded node, told to prefetch


def test_a_short_match_routes_to_the_least_loaded_node(tmp_path) -> None:
    gs = plain(tmp_path, affinity_min_blocks=4)
    gs.report_events("n1", stored("device", H[:3]))
    assert gs.admit("t", "r", block_hashes=H).node_id == "n0"  # 3 < affinity_min_blocks


def test_prefix_tiers_count_the_cheapest_tier_and_stop_at_a_miss() -> None:
    index = BlockIndex()
    index.apply("n0", stored("device", H[:2]) + stored("host", H[2:3]))
    index.apply("s0", stored("spill_ram", H[:5]) + stored("spill_disk", H[6:8]))
    index.apply("n1", stored("device", H[3:5]))  # another node's device is no use to n0
    assert index.prefix_tiers("n0", H) == PrefixTiers(device=2, host=1, spill=2)
    assert index.prefix_tiers("n1", H) == PrefixTiers(spill=3, device=2)
    assert index.node_prefix("n0", H) == 3 and index.node_prefix("n1", H) == 0


def test_admission_counts_cached_tokens_per_tier(tmp_path) -> None:
    """Prompt 100 tokens, 6 full blocks of 16: n0 holds 2 on device, 1 in host, spill 2."""
    gs = plain(tmp_path, nodes=("n0",), block_size=16)
    gs.report_events("n0", stored("device", H[:2]) + stored("host", H[2:3]))
    gs.report_events("spill_node_0", stored("spill_ram", H[:5]))
    adm = gs.admit("t", "r", block_hashes=H[:6], prompt_tokens=100)
    assert (adm.code, adm.spill_blocks) == ("OK", 2)
    assert gs.nodes["n0"].backlog.by_rank == {1: 20.0}  # the uncached 100 - 80 tokens


def test_spill_held_prefix_turns_a_rejection_into_an_admission(tmp_path) -> None:
    """Behind 100 tokens of interactive prefill, 1200 tokens at 1000 tokens/s miss a 1000 ms
    SLO (1.3 s); read from spill at 20k tokens/s they meet it (0.1 + 0.06 + 0.03 s). (With
    nothing ahead the cold request would be admitted: it misses the SLO on its own.)"""
    clock = Clock()
    gs = plain(tmp_path, nodes=("n0",), scheduler="kvstrata", clock=clock)
    tenant, key = gs.register_tenant(TenantSpec("live", "interactive"))
    gs.authenticate(key)
    gs.nodes["n0"].prefill.set(1000.0)
    gs.nodes["n0"].step_s.update(0.05)
    gs.nodes["n0"].backlog.add(0, tenant.tenant_id, 100.0, 4.0)  # its own earlier request
    gs.nodes["n0"].backlog.updated_s = clock()
    hashes = hashes_of(range(100, 175))  # 75 blocks = 1200 tokens
    assert gs.admit(tenant.tenant_id, "cold", block_hashes=hashes, prompt_tokens=1200).code == (
        "RESOURCE_EXHAUSTED"
    )
    gs.report_events("spill_node_0", stored("spill_disk", hashes))
    adm = gs.admit(tenant.tenant_id, "warm", block_hashes=hashes, prompt_tokens=1200)
    assert (adm.code, adm.spill_blocks) == ("OK", 75)
    assert gs.nodes["n0"].backlog.by_rank == {0: 100.0}  # nothing uncached joined the backlog


def test_spill_node_pushes_its_events_and_a_restart_resets_them(tmp_path) -> None:
    """SpillNode (the actor body) -> report_events, as ``create_spill_node(scheduler=...)``."""
    gs = plain(tmp_path / "state")

    def sink(node_id: str, events: list[tuple[str, bytes, str]], reset: bool) -> None:
        gs.report_events(node_id, events, reset)

    node = SpillNode(tmp_path / "spill", FMT, 4 * BLOCK, DISK, node_id="s0", event_sink=sink,
                     demote_low_watermark=0.5)
    node.put(hashes_of(range(6)), make_blocks(range(6)), "ns")  # over 4 blocks: 4 LRU to disk
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(spill_ram=2, spill_disk=4)
    assert node.take_events() == []  # the sink took them
    node.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillNode(tmp_path / "spill", FMT, 4 * BLOCK, DISK, node_id="s0", event_sink=sink)
    assert gs.stats()["indexed_blocks_by_tier"] == by_tier(spill_disk=4)  # RAM died with it
    assert restarted.flush() == 4
    assert gs.stats()["indexed_blocks"] == 0
    gs.index.check_integrity()


class _Recorder:
    """Stands in for the scheduler's data-plane sockets: records what is sent where."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict]] = []

    def send(self, address: str, message: dict) -> bool:
        self.sent.append((address, message))
        return True


def test_admit_and_submit_hands_the_request_to_the_routed_node(tmp_path) -> None:
    from cache_node.sampling_params import SamplingParams
    from services.node_request import NodeRequest

    gs = plain(tmp_path, queue_limit=1)  # 2 nodes x 4 running, then 1 may wait
    from services.data_plane import request_from_wire

    sender = _Recorder()
    gs.attach_nodes({"n0": "tcp://n0:1", "n1": "tcp://n1:1"}, sender)
    gs.report_events("n1", stored("device", H[:5]))
    gs.report_events("spill_node_0", stored("spill_ram", H[5:]))
    req = NodeRequest(request_id="r1", tenant="t", cache_namespace="", sampling=SamplingParams(),
                      token_ids=tuple(range(12 * 16 + 1)))
    adm = gs.admit_and_submit(req, "gw", H)
    assert (adm.code, adm.node_id, adm.spill_blocks) == ("OK", "n1", 7)
    (address, message), = sender.sent  # to n1 alone
    sent = request_from_wire(message["req"])
    assert address == "tcp://n1:1" and message["op"] == "submit" and message["sub"] == "gw"
    assert sent.request_id == "r1" and sent.prefetch  # told to prefetch
    # over the queue limit: rejected, and no node hears of it
    for i in range(8):  # with r1: 9 in flight, one waiting
        gs.admit("t", f"fill{i}")
    adm = gs.admit_and_submit(NodeRequest(request_id="r2", tenant="t", cache_namespace="",
                                          sampling=SamplingParams(), token_ids=(1, 2)), "gw", [])
    assert adm.code == "RESOURCE_EXHAUSTED" and len(sender.sent) == 1


def test_common_prefix_is_what_most_recent_prompts_share() -> None:
    from services.block_index import CommonPrefix

    system = hashes_of(range(3))  # 3 blocks every prompt starts with
    cp = CommonPrefix(window=40, share=0.5, refresh=1, min_prompts=8)
    for i in range(7):
        cp.observe(system + hashes_of(range(100 * i, 100 * i + 5))[3:])
    assert cp.blocks_for(system) == 0  # too few prompts to say
    cp.observe(system + hashes_of(range(900, 905))[3:])
    assert cp.blocks_for(system) == 3
    cp.observe([])  # unknown prompts (session turns) are ignored
    assert cp.blocks_for(system) == 3 and cp.blocks_for([]) == 0
    other = hashes_of([999])  # another namespace's first block
    for _ in range(40):  # that namespace's traffic changes nothing here
        cp.observe(other + hashes_of(range(1000 + _ * 10, 1000 + _ * 10 + 3)))
    assert cp.blocks_for(system) == 3 and cp.blocks_for(other) == 1
    for _ in range(40):  # this namespace's traffic changes: only its first block is shared
        cp.observe(system[:1] + hashes_of(range(2000 + _ * 10, 2000 + _ * 10 + 4)))
    assert cp.blocks_for(system) == 1
    with pytest.raises(ValueError, match="share"):
        CommonPrefix(share=0.0)


def test_affinity_needs_a_match_past_the_common_prefix(tmp_path) -> None:
    gs = plain(tmp_path, affinity_min_blocks=2)
    system = H[:4]
    # most traffic shares the first 4 blocks (chained hashes, so the same 4 hashes)
    for i in range(64):
        gs.common_prefix.observe(system + hashes_of(range(500 + 10 * i, 500 + 10 * i + 6))[4:], "t")
    assert gs.common_prefix.blocks_for(system, "t") == 4
    gs.report_events("n1", stored("device", H[:4]))
    gs.admit("t", "busy", block_hashes=[])  # n0 has one request in flight, n1 none
    gs.admit("t", "busy2", block_hashes=[])  # now one each
    gs.admit("t", "busy3", block_hashes=[])  # n0 two, n1 one
    assert gs.admit("t", "r1", block_hashes=H).node_id == "n1"  # least loaded anyway
    gs.report_events("n0", stored("device", H[:4]))
    # n0 and n1 both hold only the common prefix: load decides (n1 has 2 in flight, n0 2: tie -> n0)
    assert gs.admit("t", "r2", block_hashes=H).node_id == "n0"
    gs.report_events("n1", stored("device", H[4:6]))  # n1 now holds 6 blocks, past the common 4
    assert gs.admit("t", "r3", block_hashes=H).node_id == "n1"


def test_a_full_queue_still_admits_a_tenant_below_its_fair_share(tmp_path) -> None:
    """Regression: the queue limit was global: one tenant's burst filled it and every other
    tenant got RESOURCE_EXHAUSTED (queue_full) until it drained. Places (running capacity +
    queue_limit) are split evenly among the tenants in flight; a flood is refused at its
    share, a quiet tenant is admitted up to its own, and twice the limit waiting refuses all."""
    gs = plain(tmp_path, queue_limit=2)  # 2 nodes x 4 running + 2 waiting = 10 places
    admitted = [gs.admit("noisy", f"n{i}").code for i in range(12)]
    assert admitted == ["OK"] * 10 + ["RESOURCE_EXHAUSTED"] * 2  # alone: every place is its share
    assert gs.admit("quiet", "q0").code == "OK"  # 2 tenants: 5 places each; it holds 0
    assert gs.admit("noisy", "n12").code == "RESOURCE_EXHAUSTED"
    assert [gs.admit("quiet", f"q{i}").code for i in (1, 2)] == ["OK", "RESOURCE_EXHAUSTED"]
    assert gs._queued() == 4 and gs.admit("third", "t0").code == "RESOURCE_EXHAUSTED"  # 2 x queue_limit wait
    for i in range(10):
        gs.release(f"n{i}")
    assert gs.in_flight_by_tenant() == {"quiet": 2}
    assert gs.admit("noisy", "n20").code == "OK"


def test_one_tenants_shared_prefix_leaves_another_tenants_affinity_on(tmp_path) -> None:
    """Regression (security review): the common prefix was one statistic over every tenant's
    prompts. Tenant mallory's 64 prompts sharing a 20-block prefix made it 20 blocks, so alice's
    8-block document, held by n1, no longer counted as a match: her request went to n0. It is
    now counted per namespace (prompts with the same first block)."""
    gs = plain(tmp_path, affinity_min_blocks=2)
    doc = hashes_of(range(700, 708))  # alice's namespace: another chain
    gs.report_events("n1", stored("device", doc))
    gs.admit("t", "busy", block_hashes=[])  # n0 one in flight, n1 none
    gs.admit("t", "busy2", block_hashes=[])  # one each
    shared = hashes_of(range(20))
    for i in range(64):
        gs.admit("mallory", f"m{i}", block_hashes=shared + hashes_of(range(1000 + 10 * i, 1000 + 10 * i + 2))[20:])
        gs.release(f"m{i}", None)
    assert gs.common_prefix.blocks_for(shared, "mallory") == 20
    assert gs.common_prefix.blocks_for(shared, "alice") == gs.common_prefix.blocks_for(doc, "alice") == 0
    assert gs.admit("alice", "a1", block_hashes=doc).node_id == "n1"


def test_a_submit_the_node_cannot_take_is_refused_not_left_waiting(tmp_path) -> None:
    """Security review: the scheduler admitted a request and its submit was dropped (the
    node's inbox full, ``PushSockets.send`` False): nothing would ever answer it and its
    gateway waited forever. Now it is UNAVAILABLE (retry), released, and holds no slot."""
    from cache_node.sampling_params import SamplingParams
    from services.node_request import NodeRequest

    class Full(_Recorder):
        def send(self, address: str, message: dict) -> bool:
            return False

    gs = plain(tmp_path)
    gs.attach_nodes({"n0": "tcp://n0:1", "n1": "tcp://n1:1"}, Full())
    req = NodeRequest(request_id="r1", tenant="t", cache_namespace="", sampling=SamplingParams(),
                      token_ids=(1, 2), session_id="t/s")
    adm = gs.admit_and_submit(req, "gw", [])
    assert (adm.code, adm.reason) == ("UNAVAILABLE", "node_not_reading")
    assert not gs.requests and all(not n.in_flight for n in gs.nodes.values()) and not gs.session_nodes


def test_the_launchers_capacities_are_the_nodes_blocks() -> None:
    """``launcher.index_holders``: a cache node's capacity is its device pool's blocks (as the
    engine sizes it) plus its host tier's slots; a spill node's its RAM and disk in blocks."""
    import torch
    from transformers import AutoConfig

    from cache_node.kv_pool import KVPool
    from cache_node.model_files import resolve_model_dir
    from services.config import NodeConfig, ServiceConfig
    from services.launcher import index_holders, spill_block_spec

    config = ServiceConfig(node=NodeConfig(device="cpu", dtype="float32", kv_pool_bytes=3 << 20, host_bytes=5 << 20),
                           num_spill_nodes=2, spill_ram_bytes=7 << 20, spill_disk_bytes=12 << 20)
    mc = AutoConfig.from_pretrained(str(resolve_model_dir(config.node.model_path)))
    per_block = config.node.block_size * KVPool.bytes_per_token(
        mc.num_hidden_layers, mc.num_key_value_heads, mc.hidden_size // mc.num_attention_heads, torch.float32)
    holders = index_holders(config, spill_block_spec(config))
    assert holders.node_blocks == (3 << 20) // per_block + (5 << 20) // per_block
    assert holders.spill_blocks == dict.fromkeys(("spill_node_0", "spill_node_1"),
                                                 (7 << 20) // per_block + (12 << 20) // per_block)
