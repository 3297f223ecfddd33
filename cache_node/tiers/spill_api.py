"""The engine's narrow view of the spill tier, and the checks applied to what comes back.

The cache node never imports Ray: it talks to a ``SpillClient``, implemented in-process by
``cache_node.tiers.spill_store.SpillStore`` and, across actors, by ``services.spill_client``.
A spill block is one row ``(num_layers, 2, block_size, num_kv_heads, head_dim)`` keyed by its
32-byte chained block hash (which carries namespace, model identity and KV format) and
stored with its token ids; the engine passes the token ids on every ``get``, so a block held
under the asked hash with other tokens is a miss (as the device and host tiers check).

Whatever a client returns is untrusted: a reply that does not answer the question asked
(other hashes, another shape or dtype) is a miss as a whole, never KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:  # imported where tensors are converted: the launcher (``kvstrata up``), a spill
    import torch  # node and the cache node actor's module import this one and no torch

SPILL_HASH_BYTES = 32


class SpillReply(Protocol):
    """What ``get`` returns: hits in request order with their rows and tiers."""

    @property
    def hashes(self) -> list[bytes]: ...

    @property
    def blocks(self) -> np.ndarray: ...

    @property
    def tiers(self) -> list[str]: ...


class SpillClient(Protocol):
    """Batched, content-addressed block store (see ``SpillStore`` for the full contract).

    Faults are the client's to absorb or raise: the engine turns any exception from a call
    into a miss (``get``) or a dropped write (``put``). A ``put``'s ``weight`` is the weights of
    ``namespace``'s tenants (tenant id -> weight, ``HolderWeights.put_weight``) or of the
    namespace as a whole (``fair_lru``: the spill tiers' weighted fair shares); a store refuses
    (ValueError) one ``fair_lru.check_put_weight`` refuses. ``flush`` raises
    ``SpillFlushIncomplete`` when a node did not confirm it within ``timeout_s`` (None: the
    client's own timeout; an in-process store answers or raises at once).
    """

    def put(
        self, hashes: Sequence[bytes], blocks: np.ndarray, namespace: str,
        token_ids: Sequence[Sequence[int]] | None = None, weight: float | dict[str, float] = 1.0,
    ) -> int: ...

    def get(
        self, hashes: Sequence[bytes], token_ids: Sequence[Sequence[int]] | None = None
    ) -> SpillReply: ...

    def contains(self, hashes: Sequence[bytes]) -> list[str | None]: ...

    def flush(self, timeout_s: float | None = None) -> int: ...

    def drop_namespace(self, namespace: str) -> int: ...


class SpillFlushIncomplete(RuntimeError):
    """A spill flush that some spill nodes did not confirm within its time: they may still hold
    their blocks (alive but stopped or stuck, or dead with their group files left on disk for
    the node Ray restarts). ``dropped``: blocks the other nodes dropped; ``unflushed``: spill
    node name -> why (``"did not answer within 24 s"``, the error it failed with, ...).

    Regression (session 30, after e87d3fe): a spill node that did not answer its flush in time counted as
    0 blocks dropped and the flush as done, so ``kvstrata admin flush`` said the KV was gone
    while the spill node still held it."""

    def __init__(self, dropped: int, unflushed: dict[str, str]) -> None:
        shown = "; ".join(f"{name}: {why}" for name, why in unflushed.items())
        super().__init__(f"spill flush incomplete ({shown}); the others dropped {dropped} blocks")
        self.dropped, self.unflushed = dropped, dict(unflushed)


class SpillBlockSpec(NamedTuple):
    """How a node's blocks look in the spill tier (build the store's ``BlockFormat`` from it)."""

    shape: tuple[int, ...]  # (num_layers, 2, block_size, num_kv_heads, head_dim)
    dtype: str  # numpy dtype name; bfloat16 travels as its bits ("int16")
    kv_format: str


SPILL_TIERS = ("spill_ram", "spill_disk")
"""The tier names a spill node answers with (``SpillStore``); any other makes a reply malformed."""


def numpy_dtype_of(dtype: torch.dtype) -> np.dtype:
    """Numpy dtype a torch KV dtype travels as (bfloat16 has none: its bits as int16)."""
    import torch

    if dtype == torch.bfloat16:
        return np.dtype(np.int16)
    return torch.empty((), dtype=dtype).numpy().dtype


def numpy_dtype_name(dtype_name: str) -> str:
    """``numpy_dtype_of(getattr(torch, dtype_name)).name`` without torch, for a KV dtype name
    (``cache_node.config.DTYPE_NAMES`` less "auto"): "bfloat16" travels as "int16"."""
    return "int16" if dtype_name == "bfloat16" else np.dtype(dtype_name).name


def to_numpy(stack: torch.Tensor) -> np.ndarray:
    """CPU stack ``(n, *block_shape)`` as a numpy array sharing its memory."""
    import torch

    stack = stack.detach().cpu().contiguous()
    if stack.dtype == torch.bfloat16:
        stack = stack.view(torch.int16)
    return stack.numpy()


def from_numpy(rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Rows from the spill tier as a torch tensor of the pool's ``dtype`` (no copy when it can)."""
    import torch

    if not rows.flags.writeable:  # Ray hands out read-only zero-copy views
        rows = rows.copy()
    tensor = torch.from_numpy(rows)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def well_formed(
    reply: SpillReply, asked: Sequence[bytes], shape: Sequence[int], dtype: np.dtype
) -> tuple[list[bytes], np.ndarray, list[str]] | None:
    """``(hashes, blocks, tiers)`` of a ``get`` reply, or None when it is malformed: fields of
    the wrong type, hashes that are not bytes or were not ``asked``, a tier not in
    ``SPILL_TIERS``, ``blocks`` not exactly ``(len(hashes), *shape)`` of ``dtype`` (a reply
    crosses process boundaries: nothing is broadcast or cast into KV)."""
    try:  # every field may be of any type
        hashes, blocks, tiers = list(reply.hashes), reply.blocks, list(reply.tiers)
    except Exception:  # noqa: BLE001 - not a reply at all
        return None
    if not isinstance(blocks, np.ndarray) or blocks.shape != (len(hashes), *shape):
        return None
    if blocks.dtype != dtype or len(tiers) != len(hashes):
        return None
    if not all(isinstance(h, bytes) for h in hashes) or not all(isinstance(t, str) and t in SPILL_TIERS
                                                                  for t in tiers):
        return None  # a tier name the engine does not know would fail its accounting
    if set(hashes) - set(asked):
        return None  # answered something not asked: distrust it all
    return hashes, blocks, tiers


def leading_hits(
    reply: SpillReply, asked: Sequence[bytes], shape: Sequence[int], dtype: np.dtype
) -> tuple[np.ndarray, list[str]]:
    """The run of hits at the start of ``asked`` from a ``get`` reply.

    Returns ``(rows, tiers)`` with ``rows``: (k, *shape) for ``asked[:k]``; k is 0 when the
    first asked hash missed or the reply is malformed (fields of the wrong type, hashes that
    are not bytes, a tier not in ``SPILL_TIERS``, wrong shape or dtype).
    """
    empty = np.empty((0, *shape), dtype=dtype)
    checked = well_formed(reply, asked, shape, dtype)
    if checked is None:
        return empty, []
    hashes, blocks, tiers = checked
    k = 0
    while k < len(hashes) and k < len(asked) and hashes[k] == asked[k]:
        k += 1
    if set(hashes[k:]) - set(asked[k:]):  # answered something not asked: distrust it all
        return empty, []
    return blocks[:k], tiers[:k]
