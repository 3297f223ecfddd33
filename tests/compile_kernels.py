"""Compile the paged-attention kernels for an H100/H200 (sm_90) on a machine without a GPU.

``python -m tests.compile_kernels`` (TRITON_INTERPRET unset) runs Triton's whole pipeline,
front end to ptxas, for the launch configurations the engine uses on the acceptance shapes:
the Llama-3.1-8B shape in bf16 (32 heads, 8 KV heads, head_dim 128) and SmolLM2-135M in fp32
and bf16 (9 heads, 3 KV heads, head_dim 64); prefill-heavy and decode-heavy unified launches,
split-KV decode, a split-KV prefill chunk, and the merge. The interpreter tests check what the kernels compute; this
checks that the GPU compiler accepts them (dot shapes, loop-carried types, shared memory) and
that no configuration spills registers (cuobjdump, also bundled). Prints one line per kernel
and exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cache_node.kernels import paged_attention as pa
from cache_node.kernels import paged_attention_triton as kernels

TARGET = GPUTarget("cuda", 90, 32)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CUOBJDUMP = os.path.join(NVIDIA_BIN, "cuobjdump")
SHAPES = {  # name: (num_heads, num_kv_heads, head_dim, dtype)
    "llama-3.1-8b bf16": (32, 8, 128, torch.bfloat16),
    "smollm2-135m fp32": (9, 3, 64, torch.float32),
    "smollm2-135m bf16": (9, 3, 64, torch.bfloat16),
}
TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _signature(fn, dtype: torch.dtype, constexprs: dict[str, object]) -> dict[str, str]:
    io = {"out_ptr", "q_ptr", "k_ptr", "v_ptr"}
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + (TRITON_DTYPE[dtype] if name in io
                               else "fp32" if name in ("partial_ptr", "lse_ptr") else "i32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


def _divisibility(fn, constexprs: dict[str, object]) -> dict[tuple[int, ...], list]:
    """What a launch on the acceptance shapes specializes: every pointer is 16-byte aligned and
    every tensor stride but the block table's is a multiple of 16 (``tt.divisibility``), which
    lets the compiler vectorize loads along head_dim."""
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if name not in constexprs and (name.endswith("_ptr") or
                                           (name.startswith("stride_") and name != "stride_table"))}


def compile_one(fn, dtype: torch.dtype, constexprs: dict[str, object], **options):
    """Compile ``fn`` for sm_90; returns the compiled kernel (``.metadata``, ``.asm``)."""
    source = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs,
                       attrs=_divisibility(fn, constexprs))
    return triton.compile(source, target=TARGET, options=options)


def resource_usage(kernel) -> tuple[int, int]:
    """(registers per thread, stack bytes per thread) of a compiled kernel, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        report = subprocess.run([CUOBJDUMP, "-res-usage", cubin.name], check=True,
                                capture_output=True, text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report)
    if usage is None:
        raise RuntimeError(f"no resource usage in cuobjdump's report: {report!r}")
    return int(usage.group(1)), int(usage.group(2))


def _report(name: str, kernel) -> None:
    registers, stack = resource_usage(kernel)
    print(f"{name}: {registers} registers, {stack} B stack, {kernel.metadata.shared} B shared")
    if stack:
        raise SystemExit(f"{name} spills registers to the stack ({stack} B per thread)")


def main() -> None:
    for shape, (heads, kv_heads, head_dim, dtype) in SHAPES.items():
        # (label, tokens, sequences, splits): a prefill-heavy and a decode-heavy batch, split-KV
        # decode, and a 64-token chunk after a long cached prefix (a prefix-cache hit), split
        for label, tokens, seqs, splits in (("prefill", 2048, 4, 1), ("decode", 32, 32, 1),
                                            ("split-kv decode", 4, 4, 8),
                                            ("split-kv chunk", 64, 1, 8)):
            config = pa.unified_config(tokens, seqs, heads, kv_heads, head_dim, 16, dtype, splits)
            _report(f"{shape} unified/{label}", compile_one(
                kernels._unified_attention_kernel, dtype, config, **pa.launch_options(config)))
        merge = {"NUM_SPLITS": 8, "SPLITS_PAD": 8, "HEAD_DIM": head_dim,
                 "HEAD_DIM_PAD": triton.next_power_of_2(head_dim)}
        _report(f"{shape} merge", compile_one(kernels._merge_splits_kernel, dtype, merge,
                                              num_warps=4))


if __name__ == "__main__":
    main()
