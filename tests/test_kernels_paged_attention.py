"""Triton paged attention == the torch reference == dense SDPA per sequence (issue 17).

Without CUDA the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1``
is set here, before triton is imported. With CUDA the same tests run compiled on the GPU, and
the ``gpu``-marked tests at the end check fp32/bf16 on the device and time kernel vs reference.
Every batch stores its blocks shuffled, fills unused slots and the block tables' padding
entries' block with NaN (a stray read shows as NaN), and uses lengths that are not multiples
of the block size unless a case says otherwise.

In the interpreter (no CUDA) a few parametrizations that repeat the same kernel logic run a
covering subset (``on_device_all``): the GQA x block size x head_dim grid pairwise (each pair of
values once), the split counts with one padded and one exact power of two fewer, the bf16
prefix hit not again (its split and merge run in fp32 whatever the dtype; bf16 splits are
``test_bf16_within_stated_tolerance``'s). On CUDA every case runs. The interpreter spent
~88 s of a ~2,100-s serial suite here, ~30 s of it on those repeats.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
if not CUDA:  # tests/conftest.py sets it first; triton reads it when it is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cache_node.kernels.paged_attention as pa
from cache_node.kernels.reference import paged_attention_reference
from tests.paged_batches import dense_sdpa, make_batch

if not CUDA and not pa.INTERPRETED:
    pytest.fail("triton was imported before TRITON_INTERPRET was set (tests/triton_interpreter.py "
                "sets it from tests/conftest.py)", pytrace=False)

FP32_ATOL = 1e-4
# bf16 inputs, fp32 accumulation, bf16 output and bf16 softmax weights in the PV product
# (FlashAttention-2's choice): about 2^-8 relative on unit-scale outputs.
BF16_ATOL, BF16_RTOL = 2e-2, 2e-2

# decode; prefill from scratch; chunk after cached context; one token; a decode at a block
# boundary (32 = 2 * 16); a chunk ending on a block boundary
MIXED = [(37, 1), (23, 23), (69, 19), (1, 1), (32, 1), (48, 16)]


def on_device_all(every: list, interpreted: list) -> list:
    """``every`` case on CUDA; in Triton's interpreter the covering subset ``interpreted``."""
    assert all(case in every for case in interpreted)
    return every if CUDA else interpreted


# GQA ratio x block size x head_dim: every combination on CUDA; pairwise in the interpreter
# (each ratio with both block sizes and both head dims, each block size with each head dim)
MIXED_GRID = [(g, b, d) for g in (1, 2, 3, 4, 8) for b in (16, 32) for d in (64, 128)]
MIXED_PAIRWISE = [(1, 16, 64), (1, 32, 128), (2, 16, 128), (2, 32, 64), (3, 16, 64), (3, 32, 128),
                  (4, 16, 128), (4, 32, 64), (8, 16, 64), (8, 32, 128)]


def _check(batch, out: torch.Tensor, atol: float = FP32_ATOL, rtol: float = 0.0) -> None:
    ref = paged_attention_reference(*batch.args())
    dense = dense_sdpa(batch)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert not out.isnan().any(), "the kernel read a slot or block-table entry it must not"
    torch.testing.assert_close(out.float(), dense, atol=atol, rtol=rtol)
    torch.testing.assert_close(ref.float(), dense, atol=atol, rtol=rtol)


@pytest.mark.parametrize("group,block_size,head_dim", on_device_all(MIXED_GRID, MIXED_PAIRWISE))
def test_mixed_batch_matches_reference_and_sdpa(group: int, block_size: int,
                                                head_dim: int) -> None:
    """Decodes, prefills and chunked prefills in one launch; GQA ratio 3 is SmolLM2-135M's."""
    batch = make_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                       block_size=block_size, device=DEVICE, seed=group * block_size + head_dim)
    _check(batch, pa.paged_attention(*batch.args()))


def test_prefill_only_batch() -> None:
    batch = make_batch([(100, 100), (7, 7), (33, 33)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, device=DEVICE, seed=1)
    _check(batch, pa.paged_attention(*batch.args()))


@pytest.mark.parametrize("num_kv_splits", on_device_all([1, 3, 4, None], [1, 3, None]))
def test_decode_batch_split_kv_matches(num_kv_splits: int | None) -> None:
    """Decode only, one 1500-token context: unified kernel (1) and split-KV (3, 4, chosen: 5).
    (4 splits of a decode, unpadded: ``test_bf16_within_stated_tolerance`` in the interpreter.)"""
    batch = make_batch([(1500, 1), (37, 1), (1, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=16, device=DEVICE, seed=2)
    _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=num_kv_splits))


def test_more_splits_than_context_tiles() -> None:
    """Splits past a short context's end are empty (lse -inf) and must not poison the merge."""
    batch = make_batch([(5, 1), (70, 1)], num_heads=4, num_kv_heads=1, head_dim=128,
                       block_size=32, device=DEVICE, seed=3)
    _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=8))


@pytest.mark.parametrize("num_kv_splits", on_device_all([1, 5, None], [1, None]))
def test_chunked_prefill_over_1500_token_context(num_kv_splits: int | None) -> None:
    """A 12-token chunk after 1488 cached tokens, next to a 1500-token decode, one launch;
    unsplit, cut into 5 context ranges per query tile, and as chosen (6 here: 3 sequences'
    tiles on 2 KV heads do not fill 132 SMs; padded to 8 as 5 is)."""
    batch = make_batch([(1500, 12), (1500, 1), (40, 5)], num_heads=8, num_kv_heads=2,
                       head_dim=128, block_size=32, device=DEVICE, seed=4)
    _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=num_kv_splits))


@pytest.mark.parametrize("dtype", on_device_all([torch.float32, torch.bfloat16], [torch.float32]))
def test_prefix_hit_chunk_split_kv(dtype: torch.dtype) -> None:
    """A prefix-cache hit: a 53-token chunk (four query tiles) after 2257 cached tokens, one
    sequence. Its few programs are split over the context (9 ranges); a split holding only
    positions past a query's own (the third tile's last range of 288, from 2304, for its first
    15 rows) gives that row lse -inf, which the merge must skip. One KV head of GQA 4:
    with two (and 2064 cached tokens, where no row's range was empty) the interpreter spent
    ~9 s of CPU here, ~5 s now (2 KV heads split: ``test_decode_batch_split_kv_matches``,
    ``test_chunked_prefill_over_1500_token_context``; 8 on the GPU:
    ``test_gpu_matches_reference_on_model_shapes``)."""
    batch = make_batch([(2310, 53)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                       dtype=dtype, device=DEVICE, seed=9)
    config = pa.unified_config(53, 1, 4, 1, 64, 16, dtype)
    tiles = pa.num_query_tiles(53, 1, config["BLOCK_Q"])
    assert tiles == 4 and pa.choose_num_kv_splits(tiles, 1, batch.block_tables.shape[1] * 16, 132) == 9
    atol, rtol = (FP32_ATOL, 0.0) if dtype == torch.float32 else (BF16_ATOL, BF16_RTOL)
    _check(batch, pa.paged_attention(*batch.args()), atol, rtol)


@pytest.mark.parametrize("num_kv_splits", [1, 4])
def test_bf16_within_stated_tolerance(num_kv_splits: int) -> None:
    decode = make_batch([(300, 1), (37, 1), (1, 1)], num_heads=8, num_kv_heads=2, head_dim=128,
                        block_size=16, dtype=torch.bfloat16, device=DEVICE, seed=5)
    _check(decode, pa.paged_attention(*decode.args(), num_kv_splits=num_kv_splits),
           atol=BF16_ATOL, rtol=BF16_RTOL)
    mixed = make_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, device=DEVICE, seed=6)
    _check(mixed, pa.paged_attention(*mixed.args()), atol=BF16_ATOL, rtol=BF16_RTOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_dim_not_a_power_of_two(dtype: torch.dtype) -> None:
    """head_dim 80 is padded to 128 inside the kernels and masked on every load and store."""
    atol, rtol = (FP32_ATOL, 0.0) if dtype == torch.float32 else (5e-3, 5e-3)
    for specs, splits in ((MIXED, None), ([(200, 1), (3, 1)], 3)):
        batch = make_batch(specs, num_heads=4, num_kv_heads=2, head_dim=80, block_size=16,
                           dtype=dtype, device=DEVICE, seed=8)
        _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=splits), atol, rtol)


@st.composite
def _batches(draw):
    num_seqs = draw(st.integers(1, 4))
    specs = []
    for _ in range(num_seqs):
        q_len = draw(st.integers(1, 9))
        specs.append((q_len + draw(st.integers(0, 40)), q_len))
    return (specs, draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([8, 16])),
            draw(st.sampled_from([16, 32, 64])), draw(st.integers(0, 2**16)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_batches())
def test_random_small_batches(case) -> None:
    specs, group, block_size, head_dim, seed = case
    batch = make_batch(specs, num_heads=group, num_kv_heads=1, head_dim=head_dim,
                       block_size=block_size, device=DEVICE, seed=seed)
    _check(batch, pa.paged_attention(*batch.args()))
    _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=2))


def test_q_with_strided_token_and_head_dims() -> None:
    """q sliced out of a fused QKV projection: only its last dim is contiguous."""
    batch = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       device=DEVICE, seed=7)
    qkv = torch.cat([batch.q, torch.zeros_like(batch.q)], dim=1)
    batch.q = qkv[:, :4]
    assert not batch.q.is_contiguous()
    _check(batch, pa.paged_attention(*batch.args()))


def _mutations():
    def with_(name, value):
        return lambda args: args | {name: value(args[name])}
    return [
        ("block_tables", with_("block_tables", lambda t: t.long()), "block_tables must be"),
        ("seq_lens", with_("seq_lens", lambda t: t[:-1]), "seq_lens has"),
        ("heads", with_("q", lambda t: t[:, :3]), "not a multiple"),
        ("dtype", with_("v_cache", lambda t: t.double()), "dtypes differ"),
        ("head_dim", with_("q", lambda t: t[..., :32]), "head_dim"),
        ("block_size", with_("block_size", lambda b: 0), "block_size must be positive"),
    ]


@pytest.mark.parametrize("name,mutate,message", _mutations(), ids=[m[0] for m in _mutations()])
def test_malformed_input_raises_value_error(name, mutate, message) -> None:
    batch = make_batch([(20, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       device=DEVICE)
    names = ["q", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens", "scale",
             "block_size"]
    args = mutate(dict(zip(names, batch.args())))
    for fn in (pa.paged_attention, paged_attention_reference):
        with pytest.raises(ValueError, match=message):
            fn(**args)


def test_reference_rejects_a_query_longer_than_its_context() -> None:
    batch = make_batch([(20, 4)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    batch.seq_lens[0] = 3
    with pytest.raises(ValueError, match="seq_lens must include the new tokens"):
        paged_attention_reference(*batch.args())


def test_choose_num_kv_splits() -> None:
    # Llama-3.1-8B (8 KV heads) on an H200 (132 SMs)
    assert pa.choose_num_kv_splits(1, 8, 4096, 132) == 16  # one stream: ceil(264 / 8) capped
    assert pa.choose_num_kv_splits(4, 8, 4096, 132) == 9  # ceil(264 / 32)
    assert pa.choose_num_kv_splits(4, 8, 1024, 132) == 4  # capacity 1024 // 256
    assert pa.choose_num_kv_splits(32, 8, 4096, 132) == 1  # 256 pairs fill 132 SMs
    assert pa.choose_num_kv_splits(1, 8, 512, 132) == 1  # short contexts: not worth it
    # a prefix-cache hit: a 53-token chunk of one sequence is 4 query tiles of 16 (GQA 4)
    assert pa.num_query_tiles(53, 1, 16) == 4
    assert pa.choose_num_kv_splits(4, 8, 4096, 132) == 9
    assert pa.num_query_tiles(4, 4, 4) == 4  # decodes: one tile per sequence
    assert pa.choose_num_kv_splits(pa.num_query_tiles(2048, 4, 16), 8, 4096, 132) == 1


def test_kernels_compile_for_sm90() -> None:
    """The GPU compiler (front end to ptxas, bundled with triton) accepts every launch
    configuration of the acceptance shapes without register spills, though this machine may
    have no GPU. Guards against a kernel that only the interpreter runs, and against tile sizes
    that spill (4 warps on 64 fp32 rows spilled 496 B per thread)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-m", "tests.compile_kernels"], check=False,
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count(" 0 B stack") == 15, done.stdout


# ---- on the GPU: fp32/bf16 equivalence on real shapes, and kernel vs reference timings ----

LLAMA_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128}
SMOLLM2 = {"num_heads": 9, "num_kv_heads": 3, "head_dim": 64}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [LLAMA_8B, SMOLLM2], ids=["llama-3.1-8b", "smollm2-135m"])
def test_gpu_matches_reference_on_model_shapes(shape: dict[str, int]) -> None:
    """Compiled (not interpreted) kernels: fp32 with IEEE dot products to 1e-4, bf16 within
    the stated tolerance; mixed batch, decode batch through split-KV, 1500-token contexts, a
    prefix-hit chunk through split-KV."""
    mixed = [*MIXED, (1500, 1), (1500, 64)]
    decode = [(1500, 1), (700, 1), (37, 1), (1, 1)]
    hit = [(2117, 53)]
    for dtype, atol, rtol in ((torch.float32, FP32_ATOL, 0.0),
                              (torch.bfloat16, BF16_ATOL, BF16_RTOL)):
        for specs, splits in ((mixed, None), (decode, 8), (hit, None), (mixed, 4)):
            batch = make_batch(specs, **shape, block_size=16, dtype=dtype, device="cuda")
            _check(batch, pa.paged_attention(*batch.args(), num_kv_splits=splits), atol, rtol)


def _time_ms(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


@pytest.mark.gpu
def test_gpu_kernel_vs_reference_timing(record_property) -> None:
    """For the record (printed, and as properties in the JUnit XML): one layer of the
    Llama-3.1-8B shape in bf16. Decode reads every context token's K and V once, so its KV
    bytes / time compares with the H200's ~4.8 TB/s. The kernel must beat the padded torch
    reference in every case."""
    g = torch.Generator().manual_seed(0)
    cases = {
        "decode 32 x 256-1024": [(int(n), 1) for n in torch.randint(256, 1025, (32,),
                                                                    generator=g)],
        "decode 1 x 4096 (split-KV)": [(4096, 1)],
        "prefix hit: 53 after 2064 (split-KV)": [(2117, 53)],
        "prefill 4 x 512": [(512, 512)] * 4,
        "mixed 8 chunks of 256 after 1024 + 24 decodes of 1024": [(1280, 256)] * 8
        + [(1024, 1)] * 24,
    }
    for name, specs in cases.items():
        batch = make_batch(specs, **LLAMA_8B, block_size=16, dtype=torch.bfloat16,
                           device="cuda")
        kernel_ms = _time_ms(lambda b=batch: pa.paged_attention(*b.args()))
        reference_ms = _time_ms(lambda b=batch: paged_attention_reference(*b.args()), iters=3)
        kv_bytes = sum(n for n, _ in specs) * 2 * 8 * 128 * 2  # K and V, 8 KV heads, bf16
        line = (f"kernel {kernel_ms:.3f} ms, reference {reference_ms:.3f} ms "
                f"({reference_ms / kernel_ms:.1f}x), KV read {kv_bytes / kernel_ms / 1e6:.0f} GB/s")
        print(f"paged_attention {name}: {line}")
        record_property(f"paged_attention {name}", line)
        assert kernel_ms < reference_ms, name
