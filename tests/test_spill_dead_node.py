"""A cache node whose spill node is dead for good (s37 gap 2): what happens meanwhile.

Nothing recreates a spill node whose constructor raised or that is past its ``max_restarts``
(``services.spill_watch`` shows it ``dead``). Its cache nodes must neither hang nor lose KV
without a word: a put to it fails at once (the client's ``put_failures``, logged) and stores
nothing, a demotion to the spill tier still ends (``wait_for_transfers``), the host tier's
victims of that shard are dropped (the engine's ``spill_put_blocks`` 0: never counted as
written) and the next request recomputes them, token for token. A guard: this held before s37.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray

from cache_node.tiers.spill_format import BlockFormat
from services.spill_client import RaySpillClient
from services.spill_node import SpillNodeActor
from tests.test_tier_engine import by_tier, prompt_of, run, tiered


def test_a_dead_spill_node_fails_puts_at_once_and_the_engine_recomputes(
        tiny, tmp_path: Path, ray_cluster) -> None:  # type: ignore[no-untyped-def]
    probe = tiered(tiny)
    spec = probe.spill_block_spec()
    root = tmp_path / "spill"
    root.mkdir()
    os.chmod(root, 0o777)  # writable by others: the constructor raises; Ray does not restart it
    node = SpillNodeActor.options(max_restarts=-1, resources={}, num_cpus=0).remote(
        str(root), BlockFormat(*spec), 1 << 24, 1 << 26, node_id="spill-dead")
    with pytest.raises(ray.exceptions.ActorDiedError, match="creation task"):
        ray.get(node.ready.remote(), timeout=60)
    client = RaySpillClient([node], spec.shape, spec.dtype, get_timeout_s=30, put_timeout_s=30)
    eng = tiered(tiny, spill=client)
    p = prompt_of(300, 33)
    cold = run(eng, p)
    t0 = time.monotonic()
    assert eng.demote_all(to_spill=True) > 0
    assert eng.wait_for_transfers()
    assert time.monotonic() - t0 < 10  # a dead actor's call fails at once, not after put_timeout_s
    assert client.stats()["put_failures"] >= 1 and eng.tiers.counters["spill_put_blocks"] == 0
    again = run(eng, p)
    assert again.output_token_ids == cold.output_token_ids
    assert again.num_cached_tokens_by_tier == by_tier()  # nothing claimed from a tier that lost it
    assert client.stats()["get_failures"] >= 1
    eng.check_integrity()
