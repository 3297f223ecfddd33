"""The identity of a KV layout (``kv_format_name``), without torch: the launcher (``kvstrata up``)
computes the spill tier's block format in a process that imports no torch; ``cache_node.kv_pool``
re-exports both names."""

from __future__ import annotations

KV_CODE_VERSION = 1
"""Version of what a block's KV means for given weights and layout: bump it with any change to
how the engine computes or stores KV (RoPE applied before storing, its convention and scaling,
the pool's layout, the attention a block's keys were computed for). It is part of
``kv_format_name``, hence of every block hash and spill file header, so KV an older kvstrata
computed (spill files survive restarts and upgrades) is never served to a newer one: its
hashes no longer match, and its files are skipped as another block format.

Regression (review 27b O1): only the weights, dtype and shape keyed KV, so a change to how KV
is computed would have served the old deployment's spilled KV silently."""


def kv_format_name(dtype_name: str, num_layers: int, num_kv_heads: int, head_dim: int) -> str:
    """Identity of a KV layout (part of block hashes and spill file headers):
    ``kv<KV_CODE_VERSION>/<dtype>/L<layers>/H<kv heads>/d<head dim>``."""
    return f"kv{KV_CODE_VERSION}/{dtype_name}/L{num_layers}/H{num_kv_heads}/d{head_dim}"
