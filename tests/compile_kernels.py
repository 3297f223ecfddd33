"""Compile the paged-attention kernels for an H100/H200 (sm_90) on a machine without a GPU.

``python -m tests.compile_kernels`` (TRITON_INTERPRET unset) runs Triton's whole pipeline, front
end to ptxas, for the launch configurations the engine uses on the acceptance shapes: the
Llama-3.1-8B shape in bf16 (32 heads, 8 KV heads, head_dim 128) and SmolLM2-135M in fp32 (9
heads, 3 KV heads, head_dim 64), prefill-heavy and decode-heavy unified launches, split-KV
decode and its merge. The interpreter tests check what the kernels compute; this checks that
the GPU compiler accepts them (dot shapes, loop-carried types, shared memory). Prints one line
per kernel and exits non-zero on the first failure.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from cache_node.kernels import paged_attention as pa
from cache_node.kernels import paged_attention_triton as kernels

TARGET = GPUTarget("cuda", 90, 32)
SHAPES = {  # name: (num_heads, num_kv_heads, head_dim, dtype)
    "llama-3.1-8b": (32, 8, 128, torch.bfloat16),
    "smollm2-135m": (9, 3, 64, torch.float32),
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


def compile_one(fn, dtype: torch.dtype, constexprs: dict[str, object], **options) -> int:
    """Compile ``fn`` for sm_90; returns its shared memory in bytes."""
    source = ASTSource(fn=fn, signature=_signature(fn, dtype, constexprs), constexprs=constexprs)
    return triton.compile(source, target=TARGET, options=options).metadata.shared


def main() -> None:
    for shape, (heads, kv_heads, head_dim, dtype) in SHAPES.items():
        for label, tokens, seqs in (("prefill", 2048, 4), ("decode", 32, 32)):
            config = pa.unified_config(tokens, seqs, heads, kv_heads, head_dim, 16, dtype)
            shared = compile_one(kernels._unified_attention_kernel, dtype, config, num_warps=4,
                                 num_stages=2)
            print(f"{shape} unified/{label}: {shared} B shared")
        config = pa.split_kv_config(heads, kv_heads, head_dim, 16, dtype, 8)
        shared = compile_one(kernels._split_kv_decode_kernel, dtype, config, num_warps=4,
                             num_stages=2)
        print(f"{shape} split-kv decode: {shared} B shared")
        merge = {"NUM_SPLITS": 8, "SPLITS_PAD": 8, "HEAD_DIM": head_dim,
                 "HEAD_DIM_PAD": triton.next_power_of_2(head_dim)}
        compile_one(kernels._merge_splits_kernel, dtype, merge, num_warps=4)
        print(f"{shape} merge: ok")


if __name__ == "__main__":
    main()
