"""Engine configuration (frozen, validated, units in names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How a cache node sizes its pool and its steps.

    Attributes:
        block_size: tokens per KV block (the paging unit).
        kv_pool_bytes: byte budget of the device-tier pool tensor; the number of blocks is
            ``kv_pool_bytes // bytes_per_block``.
        max_num_batched_tokens: per-step token budget (decode tokens + prefill chunks).
        max_num_seqs: most sequences running at once.
        max_model_len: longest prompt + output a request may have (tokens); 0 = the model's
            ``max_position_embeddings``.
        dtype: torch dtype name of weights and KV ("float32", "bfloat16", "float16").
        cache_namespace_default: namespace used when a request names none.
        scheduling_policy: waiting-queue order, admission and preemption policy
            (``cache_node.scheduling``: "fcfs", "priority", "vtc", "kvstrata").
    """

    block_size: int = 16
    kv_pool_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 0
    dtype: str = "float32"
    cache_namespace_default: str = "default"
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_pool_bytes <= 0:
            raise ValueError(f"kv_pool_bytes must be positive, got {self.kv_pool_bytes}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        from cache_node.scheduling import check_policy_name

        check_policy_name(self.scheduling_policy)
