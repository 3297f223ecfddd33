"""SpillNode: a thin Ray actor over ``SpillStore`` (DESIGN.md §3, §9).

Every method forwards to the plain store, so the store is tested without Ray.
Blocks travel as numpy arrays: ``get`` returns them inside ``SpillHits`` and
Ray's object store hands them to the caller zero-copy (read-only). Batch many
blocks per call; each Ray message costs about 1 ms.

An actor restart loses the RAM tier; the disk tier is rebuilt from the group
files in ``root_dir`` when the restarted actor constructs its store, which is
why ``create_spill_node`` sets ``max_restarts``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import ray
from ray.actor import ActorHandle

from services.spill_format import BlockFormat
from services.spill_store import SpillEvent, SpillHits, SpillStore

DEFAULT_RESOURCES: dict[str, float] = {"spill_node": 1}


class SpillNode:
    """Actor body: owns one ``SpillStore``; see its methods for the contracts."""

    def __init__(
        self,
        root_dir: str | Path,
        block_format: BlockFormat,
        ram_bytes: int,
        disk_bytes: int,
        **store_options: Any,
    ) -> None:
        self._store = SpillStore(root_dir, block_format, ram_bytes, disk_bytes, **store_options)

    def ready(self) -> bool:
        """True once the store is built (its disk index rebuilt); await it after creation."""
        return True

    def put(self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str) -> int:
        """``SpillStore.put``: ``blocks`` ``(len(hashes), *shape)``; returns blocks newly stored."""
        return self._store.put(hashes, blocks, namespace)

    def get(self, hashes: Sequence[bytes]) -> SpillHits:
        """``SpillStore.get``: the hits, their blocks ``(hits, *shape)`` and tiers."""
        return self._store.get(hashes)

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]:
        """``SpillStore.contains``: the tier of each hash, or None."""
        return self._store.contains(hashes)

    def match_prefix(self, hashes: Sequence[bytes]) -> int:
        """``SpillStore.match_prefix``: number of leading hashes held."""
        return self._store.match_prefix(hashes)

    def flush(self) -> int:
        """``SpillStore.flush``: drop every block; returns how many."""
        return self._store.flush()

    def stats(self) -> dict[str, int]:
        """``SpillStore.stats``."""
        return self._store.stats()

    def take_events(self) -> list[SpillEvent]:
        """``SpillStore.take_events``: changes since the last call, oldest first."""
        return self._store.take_events()


SpillNodeActor = ray.remote(SpillNode)


def create_spill_node(
    name: str,
    root_dir: str | Path,
    block_format: BlockFormat,
    ram_bytes: int,
    disk_bytes: int,
    resources: dict[str, float] | None = None,
    *,
    max_restarts: int = -1,
    max_task_retries: int = 3,
    num_cpus: float = 0,
    lifetime: str | None = None,
    **store_options: Any,
) -> ActorHandle[SpillNode]:
    """Start a named spill node actor that restarts (rebuilding from disk) when it dies.

    Args:
        name: Ray actor name (unique in the Ray namespace).
        root_dir: the node's group-file directory; must be on the node it lands on.
        block_format, ram_bytes, disk_bytes, store_options: see ``SpillStore``.
        resources: custom resources to place it; None means ``{"spill_node": 1}``,
            ``{}`` places it anywhere.
        max_restarts: restarts allowed after a crash (-1: unlimited).
        max_task_retries: retries of a call interrupted by a crash; every
            method is idempotent except ``take_events``.
        num_cpus: CPUs it holds (0: it is I/O bound).
        lifetime: Ray actor lifetime ("detached" outlives the driver that created it).

    Returns:
        The actor handle; ``ray.get(handle.ready.remote())`` waits for the index rebuild.
    """
    options = SpillNodeActor.options(
        name=name,
        resources=DEFAULT_RESOURCES if resources is None else resources,
        max_restarts=max_restarts,
        max_task_retries=max_task_retries,
        num_cpus=num_cpus,
        lifetime=lifetime,
    )
    handle = options.remote(str(root_dir), block_format, ram_bytes, disk_bytes, **store_options)
    return cast("ActorHandle[SpillNode]", handle)
