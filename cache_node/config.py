"""Engine configuration (frozen, validated, units in names) and device resolution."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device or dtype is made: the launcher (``kvstrata up``)
    import torch  # and the cache node actor's module import this one and no torch

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def check_device_name(device: str, field: str = "device") -> str:
    """Return ``device`` when it is "auto", "cpu", "cuda" or "cuda:N"; raise ValueError naming
    ``field`` otherwise (syntax only: whether the device exists is ``resolve_device``'s check)."""
    if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
        raise ValueError(f'{field} must be "auto", "cpu", "cuda" or "cuda:N", got {device!r}')
    return device


def resolve_device(device: str) -> torch.device:
    """The concrete torch device for a device name.

    "auto" is ``cuda`` (the current CUDA device) when ``torch.cuda.is_available()``, else
    ``cpu``; "cuda" is the current CUDA device; "cuda:N" is device N.

    Raises:
        ValueError: a malformed name, CUDA asked for where ``torch.cuda.is_available()`` is
            False, or an index at or past ``torch.cuda.device_count()``.
    """
    import torch

    check_device_name(device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch.cuda.is_available() is False")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA "
                         "devices are visible")
    return torch.device("cuda", index)


def default_dtype_name(device: torch.device) -> str:
    """The dtype a device runs when the user chose none: bfloat16 on CUDA, float32 on CPU."""
    return default_dtype_for(device.type)


def default_dtype_for(device_type: str) -> str:
    """``default_dtype_name`` of a device type ("cuda", "cpu"), without torch."""
    return "bfloat16" if device_type == "cuda" else "float32"


@dataclass(frozen=True)
class EngineConfig:
    """How a cache node sizes its pool and its steps, and where it runs them.

    Attributes:
        block_size: tokens per KV block (the paging unit).
        kv_pool_bytes: byte budget of the device-tier pool tensor; the number of blocks is
            ``kv_pool_bytes // bytes_per_block``.
        max_num_batched_tokens: per-step token budget (decode tokens + prefill chunks).
        max_num_seqs: most sequences running at once.
        max_model_len: longest prompt + output a request may have (tokens); 0 = the model's
            ``max_position_embeddings``.
        dtype: torch dtype name of weights and KV ("float32", "bfloat16", "float16"), or "auto":
            bfloat16 on CUDA, float32 on CPU.
        device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"; the model,
            the pool and every per-step tensor live there.
        attention_backend: "torch" (gather + SDPA), "triton" (varlen paged-attention kernels,
            ``cache_node.kernels``) or "auto": triton on CUDA, torch on CPU
            (``cache_node.attention_backends``).
        cuda_graphs: replay CUDA graphs for decode-only steps with the triton backend on CUDA
            (captured per batch-size bucket); ignored on CPU.
        prefill_graph_max_tokens: with ``cuda_graphs``, a step of one plain sequence whose chunk
            of 2..this many tokens reaches its last known token (a prefix hit's suffix, a short
            prompt) replays a CUDA graph captured for the smallest token bucket (16, 32, 64, ...,
            this) that holds it instead of launching its kernels (~1,000 an 8B step); capped at
            ``max_num_batched_tokens``; 0 disables (``cache_node.cuda_graphs.PrefillGraphs``).
        cache_namespace_default: namespace used when a request names none.
        scheduling_policy: waiting-queue order, admission and preemption policy
            (``cache_node.scheduling``: "fcfs", "priority", "vtc", "kvstrata").
        fused_kernels: on CUDA with the triton backend, a Llama-family model's RMSNorms, SiLU-gated
            MLPs (one gate|up GEMM) and q/k rotary embeddings (one QKV GEMM) run as fused Triton
            kernels (``cache_node.kernels.fused_ops``), patched into the engine's model instance
            only (``cache_node.fused_layers``); False, CPU, the torch backend or another model
            family: transformers' stock modules.
        grammar_compile_timeout_s: limit of one structured-output grammar compile, in CPU
            seconds of its compiler process (which runs at niceness 19; killed past it, its
            request refused naming this limit), and 6 times it of wall time (a compiler the
            node's load starves: refused as the load, retry later).
        grammar_compile_workers: compiler processes (each ~76 MiB resident, started on first use).
        grammar_compile_queue_per_tenant: most grammar compiles one tenant may have queued or
            running on the node; past it a structured request is refused (retryable).
        grammar_cache_bytes: most bytes of compiled grammars kept (also at most 256 of them).
        grammar_worker_memory_bytes: what a compiler process's compiles may allocate past its
            import (its ``RLIMIT_DATA`` headroom; 0: no cap).
        grammar_request_budget_ms: most matcher time (CPU time of the step thread, as above) one
            structured-output request may take over all its steps; past it the request is
            refused naming structured_output and this limit. It bounds the matcher's memory
            (xgrammar keeps every output byte's parser states, at most ~0.2 MB per ms of
            matcher time measured: ``cache_node.grammar_mask``); a JSON schema takes ~4 us a token.
        grammar_max_active_per_tenant: most structured-output requests one tenant may have on
            the node at once (queued, compiling or decoding); past it one is refused
            RESOURCE_EXHAUSTED (retryable) naming this setting, holding nothing.
        grammar_step_budget_ms: most matcher time (CPU time of the step thread: the mask fill
            plus the last token's accept) one structured-output request may take in one step;
            past it the request is refused naming structured_output and this limit (a normal
            grammar takes ~10-50 us a step; an ambiguous one can take tens of ms, more with
            every token, holding every tenant's step).
        (``cache_node.grammars.CompileLimits``.)

    ``resolved()`` gives the concrete device, dtype and backend; the engine runs on that.
    """

    block_size: int = 16
    kv_pool_bytes: int = 256 * 1024 * 1024
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 32
    max_model_len: int = 0
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    prefill_graph_max_tokens: int = 256
    cache_namespace_default: str = "default"
    scheduling_policy: str = "fcfs"
    fused_kernels: bool = True
    grammar_compile_timeout_s: float = 10.0
    grammar_compile_workers: int = 2
    grammar_compile_queue_per_tenant: int = 8
    grammar_cache_bytes: int = 256 << 20
    grammar_worker_memory_bytes: int = 2 << 30
    grammar_step_budget_ms: float = 2.0
    grammar_max_active_per_tenant: int = 16
    grammar_request_budget_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_pool_bytes <= 0:
            raise ValueError(f"kv_pool_bytes must be positive, got {self.kv_pool_bytes}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.prefill_graph_max_tokens < 0:
            raise ValueError(f"prefill_graph_max_tokens must be >= 0 (0 disables), got {self.prefill_graph_max_tokens}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        check_device_name(self.device)
        self._check_grammar_limits()
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                             f"{self.attention_backend!r}")
        from cache_node.scheduling import check_policy_name

        check_policy_name(self.scheduling_policy)

    def _check_grammar_limits(self) -> None:
        if not 0 < self.grammar_compile_timeout_s <= 3600:
            raise ValueError(f"grammar_compile_timeout_s must be in (0, 3600], got {self.grammar_compile_timeout_s}")
        if not 1 <= self.grammar_compile_workers <= 64:
            raise ValueError(f"grammar_compile_workers must be in [1, 64], got {self.grammar_compile_workers}")
        if self.grammar_compile_queue_per_tenant < 1:
            raise ValueError("grammar_compile_queue_per_tenant must be >= 1, got "
                             f"{self.grammar_compile_queue_per_tenant}")
        if self.grammar_cache_bytes < 0 or self.grammar_worker_memory_bytes < 0:
            raise ValueError("grammar_cache_bytes and grammar_worker_memory_bytes must be >= 0")
        if not 0 < self.grammar_step_budget_ms <= 60_000:
            raise ValueError(f"grammar_step_budget_ms must be in (0, 60000], got {self.grammar_step_budget_ms}")
        if not 0 < self.grammar_request_budget_ms <= 3_600_000:
            raise ValueError("grammar_request_budget_ms must be in (0, 3600000], got "
                             f"{self.grammar_request_budget_ms}")
        if self.grammar_max_active_per_tenant < 1:
            raise ValueError("grammar_max_active_per_tenant must be >= 1, got "
                             f"{self.grammar_max_active_per_tenant}")

    def resolved(self) -> EngineConfig:
        """This config with ``device`` concrete ("cpu" or "cuda:N"), ``dtype`` a dtype name and
        ``attention_backend`` a backend name ("auto" resolved as documented above).

        Raises:
            ValueError: the device does not exist here (``resolve_device``).
        """
        device = resolve_device(self.device)
        dtype = default_dtype_name(device) if self.dtype == "auto" else self.dtype
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
        return dataclasses.replace(self, device=str(device), dtype=dtype, attention_backend=backend)

    @property
    def torch_device(self) -> torch.device:
        """``torch.device(device)``; call on a ``resolved()`` config ("auto" is no device)."""
        if self.device == "auto":
            raise ValueError("device 'auto' is not resolved: call EngineConfig.resolved() first")
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype``; call on a ``resolved()`` config."""
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is not resolved: call EngineConfig.resolved() first")
        import torch

        return getattr(torch, self.dtype)
