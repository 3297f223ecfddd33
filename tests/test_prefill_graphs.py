"""CUDA graphs for single-sequence prefill chunks (``cache_node.cuda_graphs.PrefillGraphs``).

On CPU: buckets, the step-kind predicate, the capture order, and the graph's forward over its
static buffers run eagerly (no CUDA here) against the eager step: same sampled logits, same
pool but the scratch slot. On CUDA (``gpu``): graphs captured for every bucket at build, and
replayed prefix hits give eager greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cache_node.attention_backends import TritonBackend
from cache_node.config import EngineConfig
from cache_node.cuda_graphs import PrefillGraphs, capture_largest_first, prefill_buckets
from cache_node.engine import LLMEngine
from cache_node.kernels.reference import paged_attention_reference
from cache_node.sampling_params import SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def engine_on(lm, device: str = "cpu", **overrides) -> LLMEngine:
    """An engine (triton backend, fp32) over a private copy of ``lm``'s model."""
    cfg = {"block_size": 16, "kv_pool_bytes": 1 << 20, "max_num_batched_tokens": 64, "max_num_seqs": 8,
           "device": device, "dtype": "float32", "attention_backend": "triton", "cuda_graphs": False,
           **overrides}
    return LLMEngine(copy.deepcopy(lm.model), EngineConfig(**cfg), lm.model_id, lm.eos_token_ids)


def first_step(eng: LLMEngine, prompt: list[int], warm: list[int] | None = None) -> list:
    """``warm`` generated first (its full blocks cached), then ``prompt``'s first step,
    scheduled but not run."""
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    if warm:
        eng.generate([warm], params)
    eng.add_request(prompt, params)
    return eng.scheduler.schedule()


def test_buckets_and_config() -> None:
    assert prefill_buckets(0) == prefill_buckets(1) == []
    assert prefill_buckets(2) == [2] and prefill_buckets(16) == [16]
    assert prefill_buckets(256) == [16, 32, 64, 128, 256]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert EngineConfig().prefill_graph_max_tokens == 256
    with pytest.raises(ValueError, match="prefill_graph_max_tokens must be >= 0"):
        EngineConfig(prefill_graph_max_tokens=-1)


def test_graphs_are_captured_largest_token_count_first() -> None:
    """Decode buckets (batch sizes: one token each) and prefill buckets (tokens) interleave."""
    order: list[tuple[str, int]] = []

    class Fake:
        def __init__(self, name: str, buckets: list[int], done: set[int]) -> None:
            self.name, self.buckets, self.graphs = name, buckets, dict.fromkeys(done)

        def capture(self, bucket: int) -> None:
            order.append((self.name, bucket))
            self.graphs[bucket] = None

    capture_largest_first(Fake("decode", [1, 2, 4, 8, 16, 32], {2}), Fake("prefill", [16, 32, 64], set()))
    assert order == [("prefill", 64), ("prefill", 32), ("decode", 32), ("prefill", 16), ("decode", 16),
                     ("decode", 8), ("decode", 4), ("decode", 1)]


def test_only_one_plain_sequence_reaching_its_end_replays_a_prefill_graph(tiny) -> None:
    eng = engine_on(tiny)
    assert eng.runner.prefill_graphs is None and eng.runner.graphs is None  # CPU: no graphs
    bs, last = eng.pool.block_size, eng.pool.num_blocks - 1
    graphs = PrefillGraphs(eng.runner, 48, max_blocks=8, scratch_slot=last * bs)
    assert graphs.buckets == [16, 32, 48] and graphs.bucket(17) == 32 and graphs.bucket(2) == 16
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 48"):
        graphs.bucket(49)
    with pytest.raises(ValueError, match="largest chunk of >= 2 tokens"):
        PrefillGraphs(eng.runner, 1, max_blocks=8, scratch_slot=last * bs)
    runner = eng.runner
    [(seq, n)] = batch = first_step(eng, prompt_of(48))
    assert n == 48 and not runner.single_prefill(batch)  # no prefill graphs on this runner
    runner.prefill_graphs = graphs
    assert runner.single_prefill(batch) and not runner.single_prefill(batch, all_logits=True)
    assert not runner.decode_only(batch)
    assert not runner.single_prefill([(seq, 47)])  # stops before the last known token: no sample
    assert not runner.single_prefill(batch + batch)  # two sequences
    [(cold, c)] = first_step(engine_on(tiny), prompt_of(40))
    assert c == 40 and not graphs.fits([(cold, c)])  # pads 8 rows before the chunk, none computed
    seq.num_computed_tokens = 47
    assert not runner.single_prefill([(seq, 1)])  # one token: the decode graphs' or eager
    seq.num_computed_tokens = 0
    seq.kv = object()  # a KV policy's sequence attends through its policy
    assert not runner.single_prefill(batch)
    seq.kv = None
    other = engine_on(tiny)
    other.runner.prefill_graphs = PrefillGraphs(other.runner, 48, max_blocks=8, scratch_slot=last * bs)
    [(_, n)] = long = first_step(other, prompt_of(60, 1))
    assert n == 60 and not other.runner.single_prefill(long)  # past the largest bucket
    tight = PrefillGraphs(runner, 48, max_blocks=2, scratch_slot=last * bs)
    runner.prefill_graphs = tight
    assert not runner.single_prefill(batch)  # 40 tokens need 3 blocks, past max_blocks


# (warm prompt, prompt): cold chunks of 16 and 48 tokens (a bucket's size: no padding); prefix hits of 32 cached tokens and
# suffixes of 2, 16 and 40 tokens (buckets 16, 16, 48); 17 tokens after 48 cached.
CASES = {
    "cold-16": (None, prompt_of(16), 0, 16, 16),
    "cold-48": (None, prompt_of(48), 0, 48, 48),
    "hit-32+2": (prompt_of(40), prompt_of(34), 32, 2, 16),
    "hit-32+16": (prompt_of(40), prompt_of(48), 32, 16, 16),
    "hit-32+40": (prompt_of(40), prompt_of(72), 32, 40, 48),
    "hit-48+17": (prompt_of(50), prompt_of(65), 48, 17, 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_graph_forward_equals_the_eager_step(tiny, case, monkeypatch) -> None:
    """The graph's forward over the static buffers (run eagerly: no CUDA here) samples the
    eager step's logits from row q - 1, and leaves the pool as the eager step does but for the
    scratch slot (padded rows write only there). Reference kernel (it checks the metadata)."""
    monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    check_against_eager(tiny, *CASES[case])


def test_prefill_graph_forward_with_the_triton_kernel(tiny) -> None:
    """As above through the Triton kernel itself (interpreted): padded query tiles and the
    KV tiles past the real rows (weighted 0) leave the real rows' attention unchanged."""
    check_against_eager(tiny, *CASES["hit-48+17"])


def check_against_eager(lm, warm: list[int] | None, prompt: list[int], cached: int, q: int, bucket: int) -> None:
    eng = engine_on(lm)
    bs, last = eng.pool.block_size, eng.pool.num_blocks - 1
    [(seq, n)] = batch = first_step(eng, prompt, warm)
    assert (seq.num_computed_tokens, n) == (cached, q) and cached + q == len(prompt)
    assert all(b.block_id != last for b in seq.block_table)
    graphs = PrefillGraphs(eng.runner, 48, max_blocks=8, scratch_slot=last * bs)
    eng.runner.prefill_graphs = graphs
    assert eng.runner.single_prefill(batch)
    eng.runner.prefill_graphs = None  # the eager step
    pool_before = eng.pool.kv.clone()
    eager = eng.runner.execute(batch)
    assert eager.shape == (1, lm.model.config.vocab_size)
    pool_after_eager = eng.pool.kv.clone()
    eng.pool.kv.copy_(pool_before)
    assert graphs.load(batch) == bucket
    pad = bucket - q  # the real rows are the last q
    assert graphs.seq_lens.tolist() == [cached + q]  # the kernel reads no slot past the chunk
    assert graphs.positions[pad:bucket].tolist() == list(range(cached, cached + q))
    assert graphs.input_ids[pad:bucket].tolist() == prompt[cached:]
    assert (graphs.slot_mapping[:pad] == last * bs).all() and (graphs.positions[:pad] == 0).all()
    blocks = [b.block_id for b in seq.block_table[: -(-len(prompt) // bs)]]
    assert graphs.block_tables[0, : len(blocks)].tolist() == blocks
    assert graphs.query_start_loc[bucket].tolist() == [0, bucket]
    # stale slots past the chunk (the last block's unwritten tail, block 0) hold non-finite
    # values: no real row may see them (review 21b, P1: 0 * inf made every real row NaN)
    end = cached + q
    tail = [blocks[-1] * bs + i for i in range(end % bs, bs)] if end % bs else []
    stale = tail + ([] if 0 in blocks else list(range(bs)))  # and block 0, when not the sequence's
    flat = eng.pool.kv  # (layers, 2, slots, H_kv, d)
    for slot in stale:
        flat[:, :, slot] = float("inf")
    with torch.inference_mode():
        logits = eng.runner.model.lm_head(graphs._forward(bucket)[bucket - 1 : bucket]).float()
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    for slot in stale:  # put the stale slots back for the pool comparison
        flat[:, :, slot] = pool_after_eager[:, :, slot]
    # Real rows write their slots with the eager step's K/V (a chunk of Q rows may take another
    # GEMM blocking than one of q on some CPUs: within tolerance); nothing else but the scratch.
    same = torch.isclose(eng.pool.kv, pool_after_eager, rtol=1e-4, atol=1e-5)
    changed = (~same).flatten(3).any(-1).any(0).any(0).nonzero().flatten()
    assert changed.tolist() == ([last * bs] if q < bucket else [])  # a full bucket pads no row


def test_engine_steps_through_the_prefill_graph_path_on_cpu(tiny, monkeypatch) -> None:
    """Whole requests with the graph's replay swapped for its forward over the static buffers
    (eager, on CPU): cold prompts and prefix hits give the eager engine's greedy tokens, and
    every eligible step (one sequence, chunk of 2..48 ending its prompt) went through ``run``."""
    monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    base = prompt_of(70, 3)
    prompts = [prompt_of(5), base, *(base + prompt_of(k, 50 + k) for k in (2, 9, 16, 30))]
    runs = {}
    for graphs in (False, True):
        eng = engine_on(tiny)
        runs[graphs] = prefix_hit_tokens(eng, prompts, graphs)
    assert runs[True][0] == runs[False][0]
    # 5-token prompt (cold, pads 11 rows: eager); base: 64 + 6 (ends its prompt); hits: 6 + k
    # tokens after 64 cached
    assert runs[False][1] == 0 and runs[True][1] == 5


def prefix_hit_tokens(eng: LLMEngine, prompts: list[list[int]], graphs: bool) -> tuple[list, int]:
    """Greedy tokens of ``prompts``, one request at a time (later ones hit earlier ones'
    cached blocks), and how many steps went through ``PrefillGraphs.run``. ``graphs`` on a CPU
    engine: prefill graphs (largest 48) whose replay runs their forward eagerly."""
    if graphs and eng.runner.prefill_graphs is None:
        bs, last = eng.pool.block_size, eng.pool.num_blocks - 1
        # the last block stays free here (128 blocks, these prompts take < 40): the scratch
        pg = PrefillGraphs(eng.runner, 48, max_blocks=16, scratch_slot=last * bs)
        pg.replay = pg._forward  # type: ignore[method-assign]
        eng.runner.prefill_graphs = pg
    runs = 0
    pg = eng.runner.prefill_graphs
    if pg is not None:
        inner = pg.run

        def counted(batch):
            nonlocal runs
            runs += 1
            return inner(batch)
        pg.run = counted  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    outs = [eng.generate([p], params)[0].output_token_ids for p in prompts]
    eng.check_integrity()
    return outs, runs


# ---- on CUDA ------------------------------------------------------------------------------


@pytest.mark.gpu
def test_prefill_graphs_are_captured_for_every_bucket_at_build(tiny) -> None:
    eng = engine_on(tiny, "cuda", cuda_graphs=True, max_num_batched_tokens=512)
    graphs = eng.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16, 32, 64, 128, 256]
    assert set(graphs.graphs) == set(graphs.buckets)
    assert set(eng.runner.graphs.graphs) == set(eng.runner.graphs.buckets)
    capped = engine_on(tiny, "cuda", cuda_graphs=True, max_num_batched_tokens=100)
    assert capped.runner.prefill_graphs.buckets == [16, 32, 64, 100]
    assert set(capped.runner.prefill_graphs.graphs) == {16, 32, 64, 100}
    off = engine_on(tiny, "cuda", cuda_graphs=True, prefill_graph_max_tokens=0)
    assert off.runner.prefill_graphs is None and off.runner.graphs is not None


@pytest.mark.gpu
@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
def test_prefill_graph_replay_equals_eager(tiny, shape) -> None:
    """Prefix hits with suffixes of 2-200 tokens (every bucket), replayed from prefill graphs,
    give eager greedy tokens, token for token (fp32)."""
    from cache_node.model_shapes import random_model

    lm = tiny if shape == "tiny" else random_model(shape, torch.float32, "cpu", seed=0)
    base = prompt_of(300 if shape == "tiny" else 700, 3)
    suffixes = (2, 7, 16, 17, 50, 100, 200)  # chunks of 12 + k tokens after 288 / 688 cached
    prompts = [base, *(base + prompt_of(k, 100 + k) for k in suffixes)]
    runs = {}
    for graphs in (False, True):
        eng = engine_on(lm, "cuda", cuda_graphs=graphs, kv_pool_bytes=256 << 20, max_num_batched_tokens=512)
        assert (eng.runner.prefill_graphs is not None) == graphs
        runs[graphs] = prefix_hit_tokens(eng, prompts, graphs)
    assert runs[True][0] == runs[False][0]
    # every prefix hit replays; so does the 700-token base's last chunk (188 tokens after 512)
    assert runs[False][1] == 0 and runs[True][1] == len(suffixes) + (shape != "tiny")


def test_graph_capture_records_no_autograd(tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review 24g F1: ``_build_graphs`` ran its 33 capture forwards with autograd on (only
    ``execute`` was under inference mode) over weights that require grad, so with fused kernels
    off the pool's K/V writes made ``pool.kv`` require grad, its autograd chain kept every
    capture's activations alive (~4.7 GiB on the Llama-3.1-8B shape) and grew with each tier
    copy. Emulated on CPU: the capture's forwards run as ``GraphPool.capture`` runs them."""
    import cache_node.cuda_graphs as cg

    monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    monkeypatch.setattr(cg.GraphPool, "capture", lambda self, forward: (None, [forward() for _ in range(3)][-1]))
    eng = engine_on(tiny, prefill_graph_max_tokens=48, fused_kernels=False)
    assert torch.is_grad_enabled()  # as at a node's start
    eng.runner._build_graphs((eng.pool.num_blocks - 1) * eng.pool.block_size)
    assert not eng.pool.kv.requires_grad and eng.pool.kv.grad_fn is None
    assert not any(p.requires_grad for p in eng.runner.model.parameters())
    eng.runner.graphs = eng.runner.prefill_graphs = None  # the stub captured no graph: run eagerly
    out = eng.generate([prompt_of(40)], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4 and not eng.pool.kv.requires_grad
