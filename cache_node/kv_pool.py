"""The device-tier KV pool tensor: allocated once, addressed by slot."""

from __future__ import annotations

import numpy as np
import torch

from cache_node.kv_format import KV_CODE_VERSION, kv_format_name  # noqa: F401 - re-exported


def block_slots(block_ids: list[int], block_size: int, num_tokens: int) -> np.ndarray:
    """Slots of the first ``num_tokens`` tokens of a block table: (num_tokens,) int64, token
    ``t`` at ``block_ids[t // block_size] * block_size + t % block_size``."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * block_size + np.arange(block_size)).reshape(-1)[:num_tokens]


class KVPool:
    """One tensor holding every layer's keys and values.

    ``kv``: (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim); index 0 of
    dim 1 is keys, 1 is values. A token's slot is ``block_id * block_size + offset``.
    Bytes per token = ``2 * num_layers * num_kv_heads * head_dim * dtype_bytes``.

    Keys are stored after RoPE (true absolute positions), so moved or recalled KV never
    needs re-rotation.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(
            (num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim, self.kv.dtype
        )

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def write(self, layer_idx: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store new tokens' K/V. ``key``/``value``: (num_tokens, num_kv_heads, head_dim)."""
        self.kv[layer_idx, 0].index_copy_(0, slot_mapping, key.to(self.kv.dtype))
        self.kv[layer_idx, 1].index_copy_(0, slot_mapping, value.to(self.kv.dtype))

    def blocks_view(self) -> torch.Tensor:
        """(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim) view of ``kv``."""
        return self.kv.view(
            self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy out blocks: (n, num_layers, 2, block_size, num_kv_heads, head_dim)."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        return self.blocks_view().index_select(2, idx).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Copy blocks in; ``data`` shaped as ``read_blocks`` returns."""
        idx = torch.as_tensor(block_ids, dtype=torch.long, device=self.kv.device)
        self.blocks_view().index_copy_(2, idx, data.permute(1, 2, 0, 3, 4, 5).to(self.kv))
