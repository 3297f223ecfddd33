"""``kvstrata admin flush`` says what it counted: its blocks freed in all and per tier.

Regression (new-user report): Flush's one count covered the device, host and spill tiers and
the stored compressed prefixes, while the CLI printed "N cached blocks freed", which read as
device (GPU) blocks only. Now ``LLMEngine.flush_by_tier`` returns each kind, the node and
``AdminServicer.Flush`` carry them (``FlushResponse``'s per-tier fields, summing to
``freed_blocks``) and the CLI prints each.
"""

from __future__ import annotations

import asyncio
from typing import Any

from cache_node.sampling_params import SamplingParams
from cli.admin import flush_summary
from kvstrata.v1 import admin_pb2
from services.gateway_admin import AdminServicer
from tests.test_tier_engine import prompt_of, run, store_for, tiered


def test_the_engine_counts_each_tier_it_flushes(tiny, tmp_path) -> None:
    """Blocks demoted to the spill tier, then to the host tier, cached on the device and held
    by a stored compressed prefix are each counted under their own kind, and nothing twice."""
    eng = tiered(tiny)
    eng = tiered(tiny, spill=store_for(eng, tmp_path))
    run(eng, prompt_of(100, 1))
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    run(eng, prompt_of(120, 2))
    assert eng.demote_all() == 7
    run(eng, prompt_of(150, 3))
    doc = prompt_of(100, 4)
    eng.generate([doc + [5, 6]], SamplingParams(max_tokens=2), policy="h2o-0.5", prefix_tokens=len(doc))
    before = eng.stats()
    spill = eng.tiers.spill.stats()["blocks_spill_ram"]
    assert (before["host_blocks"], spill) == (7, 6)
    assert before["cached_blocks"] > 0 and before["compressed_prefix_blocks"] > 0
    dropped = eng.flush_by_tier()
    assert dropped == {"device": before["cached_blocks"], "prefixes": before["compressed_prefix_blocks"],
                       "host": 7, "spill": 6}
    after = eng.stats()
    assert (after["cached_blocks"], after["host_blocks"], after["compressed_prefix_blocks"], after["used_blocks"]) \
        == (0, 0, 0, 0)
    eng.check_integrity()


class _Node:
    """A node's ``flush_by_tier`` answer (``None``: it fails, as a dead actor's call does)."""

    def __init__(self, answer: dict[str, int] | None) -> None:
        self.answer = answer
        self.flush_by_tier = self

    async def remote(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        if self.answer is None:
            raise RuntimeError("node down")
        return self.answer


class _Scheduler:
    class flush_index:  # a Ray method's shape: flush_index.remote()
        @staticmethod
        async def remote() -> None:
            return None


class _Auth:
    async def admin(self, context: Any) -> None:
        return None

    async def recheck(self, context: Any, caller: Any) -> Any:  # the admin key, still valid
        return caller


def test_flush_answers_each_tier_and_the_cli_names_them() -> None:
    """``AdminServicer.Flush`` sums each kind over the nodes that answered; ``freed_blocks`` is
    their sum, and the CLI's line names every tier. Before: one count, printed as "N cached
    blocks freed"."""
    nodes = {"n0": _Node({"device": 5, "prefixes": 2, "host": 7, "spill": 6}),
             "n1": _Node({"device": 1, "prefixes": 0, "host": 3, "spill": 0})}
    # (a node whose call fails makes the flush incomplete: tests/test_admin_flush_partial.py)
    servicer = AdminServicer(_Scheduler(), _Auth(), nodes, node_timeout_s=5.0)  # type: ignore[arg-type]
    resp = asyncio.run(servicer.Flush(admin_pb2.FlushRequest(), None))
    assert (resp.freed_blocks, resp.device_blocks, resp.prefix_blocks, resp.host_blocks, resp.spill_blocks) \
        == (24, 6, 2, 10, 6)
    assert flush_summary(resp) == ("flushed: 24 KV blocks freed, all tiers: 6 cached on the device tier, 2 of "
                                   "stored compressed prefixes (device tier), 10 on the host tier, 6 on the "
                                   "spill tier (RAM and disk)")
