"""Device selection end to end (issue 17): config validation and resolution, the model on its
device, per-step tensors on the pool's device, batched sampling, attention backends, and (GPU
machines only, ``-m gpu``) CUDA against CPU and transformers."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from cache_node.attention_backends import TorchBackend, TritonBackend, get_backend
from cache_node.config import EngineConfig, resolve_device
from cache_node.engine import LLMEngine
from cache_node.kernels.reference import paged_attention_reference
from cache_node.model_runner import ModelRunner
from cache_node.model_shapes import MODEL_SHAPES, random_model, shape_config
from cache_node.policies import known_policies, make_policy
from cache_node.sampler import sample
from cache_node.sampling_params import SamplingParams
from cache_node.sequence import Sequence

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:", "cuda:x", "cpu:0", "", "mps"])
def test_a_malformed_device_is_refused_naming_the_field(bad: str) -> None:
    with pytest.raises(ValueError, match=r'device must be "auto", "cpu", "cuda" or "cuda:N"'):
        EngineConfig(device=bad)


def test_bad_dtype_and_backend_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(dtype="float64")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flash")


def test_auto_resolves_to_this_machine() -> None:
    """auto = cuda when available, else cpu; dtype auto = bfloat16 on CUDA, float32 on CPU;
    backend auto = triton on CUDA, torch on CPU; explicit choices are kept."""
    cfg = EngineConfig().resolved()
    if CUDA:
        assert (cfg.device, cfg.dtype, cfg.attention_backend) == (
            f"cuda:{torch.cuda.current_device()}", "bfloat16", "triton")
    else:
        assert (cfg.device, cfg.dtype, cfg.attention_backend) == ("cpu", "float32", "torch")
    kept = EngineConfig(device="cpu", dtype="bfloat16", attention_backend="triton").resolved()
    assert (kept.device, kept.dtype, kept.attention_backend) == ("cpu", "bfloat16", "triton")
    assert kept.torch_device == torch.device("cpu") and kept.torch_dtype is torch.bfloat16
    with pytest.raises(ValueError, match="not resolved"):
        _ = EngineConfig().torch_device


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"torch.cuda.is_available\(\) is False"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match="is_available"):
        EngineConfig(device="cuda").resolved()


def test_node_config_device_and_launcher_resolution() -> None:
    """A node is "auto" | "cpu" | "cuda" (Ray picks the GPU); the launcher makes auto concrete
    from the cluster's GPU count, with bfloat16 as the CUDA default dtype."""
    pytest.importorskip("ray")  # services/ need Ray, absent on the GPU machine: imported here
    from services.config import NodeConfig
    from services.launcher import resolve_node_config

    with pytest.raises(ValueError, match="device must be one of"):
        NodeConfig(device="cuda:1")
    with pytest.raises(ValueError, match="dtype must be one of"):
        NodeConfig(dtype="int8")
    auto = NodeConfig()
    assert (resolve_node_config(auto, 0).device, resolve_node_config(auto, 0).dtype) == ("cpu", "float32")
    assert (resolve_node_config(auto, 8).device, resolve_node_config(auto, 8).dtype) == ("cuda", "bfloat16")
    fixed = NodeConfig(device="cpu", dtype="bfloat16")
    assert resolve_node_config(fixed, 8) == fixed


def test_random_model_shapes_match_the_published_configs() -> None:
    """Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab
    128256, rope theta 500000: 16.06 GB of bf16 weights (counted on the meta device)."""
    cfg = shape_config("llama-3.1-8b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.intermediate_size, cfg.vocab_size) == (4096, 32, 32, 8, 14336, 128256)
    assert cfg.rope_parameters["rope_theta"] == 500000.0
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) * 2 == 16_060_522_496
    with pytest.raises(ValueError, match="unknown model shape 'gpt2'; known"):
        shape_config("gpt2")
    assert sorted(MODEL_SHAPES) == ["llama-3.1-8b", "smollm2-135m"]


def test_random_model_is_built_on_its_device_in_its_dtype() -> None:
    lm = random_model(shape_config("smollm2-135m", num_hidden_layers=2), torch.bfloat16, "cpu", seed=3)
    assert {p.device.type for p in lm.model.parameters()} == {"cpu"}
    assert {p.dtype for p in lm.model.parameters()} == {torch.bfloat16}
    assert lm.model_id == "random-llama-h576-l2@seed3:bfloat16:cpu"
    again = random_model(shape_config("smollm2-135m", num_hidden_layers=2), torch.bfloat16, "cpu", seed=3)
    assert torch.equal(lm.model.lm_head.weight, again.model.lm_head.weight)  # seeded


# ---- per-step tensors on the pool's device ------------------------------------------------

DEVICE = "cuda" if CUDA else "cpu"


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def engine_on(lm, backend: str = "torch", device: str = DEVICE, **overrides) -> LLMEngine:
    """An engine over a private copy of ``lm``'s model (the engine moves its model); decode
    graphs only when asked (the reference kernel syncs with the host, which capture forbids)."""
    cfg = {"block_size": 16, "kv_pool_bytes": 1 << 20, "max_num_batched_tokens": 32, "max_num_seqs": 8,
           "device": device, "dtype": "float32", "attention_backend": backend, "cuda_graphs": False,
           **overrides}
    return LLMEngine(copy.deepcopy(lm.model), EngineConfig(**cfg), lm.model_id, lm.eos_token_ids)


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor reachable from a metadata object (dataclass fields, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) if f.name != "kv" for t in tensors_in(getattr(obj, f.name))]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_metadata_tensor_is_on_the_pools_device(tiny, backend, monkeypatch) -> None:
    """Issue 17: on CUDA the first step failed with 'index is on cpu' (slot mappings, masks and
    block tables were built on the CPU). Every tensor of every step's metadata (prefill chunks
    with cached context, decodes, a policy sequence) is on the pool's device, and the step's
    integer inputs are views of one buffer (one host->device copy per step)."""
    monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    eng = engine_on(tiny, backend)
    seen, buffers = [], set()
    plain_metadata = eng.runner.metadata

    def metadata(host, dev):
        buffers.add(frozenset(t.untyped_storage().data_ptr() for t in dev.values()))
        md = plain_metadata(host, dev)
        seen.append(md)
        return md

    monkeypatch.setattr(eng.runner, "metadata", metadata)
    eng.generate([prompt_of(40)], SamplingParams(max_tokens=2, ignore_eos=True))  # cached blocks
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.generate([prompt_of(40) + [9, 9], prompt_of(50, 1), prompt_of(12, 2)], params)
    eng.generate([prompt_of(60, 3)], params, policy="streaming-24")
    kinds = {type(md.backend).__name__ for md in seen} | {"policy" for md in seen if md.policy_chunks}
    assert {"policy", "TorchMetadata" if backend == "torch" else "VarlenMetadata"} <= kinds
    tensors = [t for md in seen for t in tensors_in(md)]
    assert all(len(tensors_in(md)) >= 2 for md in seen)  # slot mapping + the attention's own
    assert {t.device for t in tensors} == {eng.pool.kv.device}
    assert all(len(ptrs) == 1 for ptrs in buffers)  # one buffer per step
    eng.check_integrity()


def reference_sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """The per-row sampler the batched one replaced (argmax or top-p draw, row by row)."""
    out = []
    for row, seq in zip(logits, seqs):
        params = seq.sampling_params
        if params.greedy:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(row / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            keep = sorted_probs.cumsum(0) - sorted_probs < params.top_p
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_probs[keep]
            probs = filtered / filtered.sum()
        out.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return out


def test_batched_sampling_equals_the_per_row_reference() -> None:
    """Greedy rows by one batched argmax, seeded rows by their own generators, one tolist():
    the same tokens as the per-row sampler, draw for draw over 20 steps."""
    kinds = [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=1),
             SamplingParams(temperature=1.3, seed=2), SamplingParams(),
             SamplingParams(temperature=0.5, top_p=0.5, seed=3)]

    def seqs() -> list[Sequence]:
        out = [Sequence(str(i), [1], p) for i, p in enumerate(kinds)]
        for s in out:
            if not s.sampling_params.greedy:
                s.generator = torch.Generator(device=DEVICE).manual_seed(s.sampling_params.seed)
        return out

    batched, reference = seqs(), seqs()
    torch.manual_seed(0)
    drawn = []
    for _ in range(20):
        logits = torch.randn(len(kinds), 300, device=DEVICE) * 3
        got = sample(logits, batched)
        assert got == reference_sample(logits, reference)
        assert all(type(t) is int for t in got)
        drawn.append(got)
    assert len({d[1] for d in drawn}) > 3 and len({d[0] for d in drawn}) > 3  # draws and argmaxes vary
    assert sample(torch.zeros(0, 300, device=DEVICE), []) == []


# ---- attention backends -------------------------------------------------------------------


def mixed_workload(eng: LLMEngine) -> list[tuple[int, ...]]:
    """Prefill chunks beside decodes, prefix hits, and a policy sequence in the same steps."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = eng.generate([prompt_of(37)], params)
    batch = [prompt_of(37) + [5, 6, 7], prompt_of(45, 1), prompt_of(9, 2), prompt_of(20, 4)]
    ids = [eng.add_request(p, params) for p in batch]
    ids.append(eng.add_request(prompt_of(50, 5), params, policy="h2o-24"))
    done: dict[str, tuple[int, ...]] = {}
    while len(done) < len(ids):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    assert eng.requests == {} and first[0].num_cached_tokens == 0
    eng.check_integrity()
    return [first[0].output_token_ids] + [done[i] for i in ids]


@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_triton_backend_greedy_equals_torch_backend(tiny, kernel, monkeypatch) -> None:
    """The varlen backend (one kernel call per layer for every plain sequence; policy
    sequences attend through their layout) gives the torch backend's greedy tokens, token for
    token, with prefill chunks, decodes, prefix hits and a policy sequence mixed in steps. The
    Triton kernel runs under TRITON_INTERPRET=1 without CUDA."""
    if kernel == "triton":
        pytest.importorskip("triton")
        import cache_node.kernels.paged_attention as pa

        if not CUDA and not pa.INTERPRETED:
            pytest.skip("triton was imported before TRITON_INTERPRET was set (tests/triton_interpreter.py)")
    else:
        monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    expected = mixed_workload(engine_on(tiny, "torch"))
    eng = engine_on(tiny, "triton")
    assert type(eng.runner.backend) is TritonBackend
    assert mixed_workload(eng) == expected
    assert eng.stats()["cached_blocks"] > 0


def test_backend_names_are_checked_and_chosen_by_device() -> None:
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; known: \['torch', 'triton'\]"):
        get_backend("flash")
    assert get_backend(EngineConfig(device="cpu").resolved().attention_backend) is TorchBackend
    assert not ModelRunner.uses_cuda_graphs(EngineConfig(device="cpu", attention_backend="triton").resolved())


# ---- CUDA-graph decode --------------------------------------------------------------------


def decode_ready(eng: LLMEngine, prompts: list[list[int]]) -> list:
    """Step ``prompts`` until every one has an output token; returns the next (decode-only)
    batch, scheduled but not run."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    while any(not eng.requests[i].output_token_ids for i in ids):
        eng.step()
    batch = eng.scheduler.schedule()
    assert len(batch) == len(prompts) and all(n == 1 for _, n in batch)
    return batch


def test_decode_graph_buckets_pad_into_the_scratch_slot(tiny, monkeypatch) -> None:
    """Graph inputs: a batch of 3 pads to bucket 4; the padded row decodes token 0 at position
    0 and writes only the scratch slot. The graph's forward over the static buffers (run
    eagerly: no CUDA here) gives the eager step's logits, and the pool differs from the eager
    step's only in the scratch slot."""
    from cache_node.cuda_graphs import DecodeGraphs, decode_buckets

    assert decode_buckets(1) == [1] and decode_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert decode_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    monkeypatch.setattr(TritonBackend, "kernel", staticmethod(paged_attention_reference))
    eng = engine_on(tiny, "triton")
    batch = decode_ready(eng, [prompt_of(20), prompt_of(35, 1), prompt_of(3, 2)])
    bs, last = eng.pool.block_size, eng.pool.num_blocks - 1
    assert all(b.block_id != last for seq, _ in batch for b in seq.block_table)
    graphs = DecodeGraphs(eng.runner, max_num_seqs=6, max_blocks=8, scratch_slot=last * bs)
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 6"):
        graphs.bucket(7)
    eng.runner.graphs = graphs  # only the step-kind predicate: replay needs CUDA
    assert eng.runner.decode_only(batch) and not eng.runner.decode_only(batch, all_logits=True)
    seq = batch[0][0]
    seq.num_computed_tokens -= 1  # one token of a chunk that does not reach the end: no sample row
    assert not eng.runner.decode_only(batch)
    seq.num_computed_tokens += 1
    eng.runner.graphs = None
    eager = eng.runner.execute(batch)
    pool_after_eager = eng.pool.kv.clone()
    assert graphs.load(batch) == 4
    assert graphs.slot_mapping[3] == last * bs and graphs.seq_lens[3] == 1 and graphs.positions[3] == 0
    assert graphs.seq_lens[:3].tolist() == [seq.num_computed_tokens + 1 for seq, _ in batch]
    with torch.inference_mode():
        logits = eng.runner.model.lm_head(graphs._forward(4)[:3]).float()
    torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)
    # The real rows rewrite their slots with the same KV up to float rounding (a batch of 4 may
    # take another GEMM blocking than a batch of 3 on some CPUs): compare within tolerance.
    same = torch.isclose(eng.pool.kv.float(), pool_after_eager.float(), rtol=1e-4, atol=1e-5)
    changed = (~same).flatten(3).any(-1).any(0).any(0).nonzero().flatten()
    assert changed.tolist() == [last * bs]


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager(tiny) -> None:
    """Decode steps replayed from graphs (buckets 1, 2, 4, 8) give eager decoding's greedy
    tokens, token for token (fp32, triton backend)."""
    prompts = [prompt_of(n, n) for n in (5, 17, 33, 64, 90)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        eng = engine_on(tiny, "triton", "cuda", cuda_graphs=graphs, max_num_batched_tokens=256)
        if graphs:  # every bucket captured when the engine is built, none inside a step
            assert set(eng.runner.graphs.graphs) == set(eng.runner.graphs.buckets)
        assert (eng.runner.graphs is not None) == graphs
        outs[graphs] = [o.output_token_ids for o in eng.generate(prompts, params)]
        outs[graphs] += [o.output_token_ids for o in eng.generate(prompts[:2], params)]
        eng.check_integrity()
        if graphs:
            assert set(eng.runner.graphs.graphs) >= {2, 8}
    assert outs[True] == outs[False]


def shape_prompts() -> list[list[int]]:
    """8 prompts of 10-1500 tokens; the 2nd and 5th extend the 1st and 4th (prefix hits)."""
    lengths = (10, 60, 150, 300, 500, 800, 1100, 1500)
    out = [[(13 * i + 7 * n) % 49000 + 100 for i in range(n)] for n in lengths]
    out[1] = out[0] + out[1][10:]
    out[4] = out[3] + out[4][300:]
    return out


@pytest.mark.gpu
def test_greedy_equals_transformers_generate_on_smollm2_shape_cuda() -> None:
    """Issue 17 acceptance: a random-weight SmolLM2-135M shape in fp32 on CUDA, 8 prompts of
    10-1500 tokens in one batch (prefill chunks beside decodes, prefix hits from a warm-up
    request), greedy tokens equal transformers ``generate`` (sdpa) token for token."""
    lm = random_model("smollm2-135m", torch.float32, "cuda", seed=0)
    ref = copy.deepcopy(lm.model)
    ref.config._attn_implementation = "sdpa"
    eng = LLMEngine(lm.model, EngineConfig(device="cuda", dtype="float32", kv_pool_bytes=1 << 30,
                                           max_num_batched_tokens=512, max_num_seqs=8), lm.model_id)
    prompts = shape_prompts()
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    eng.generate([prompts[1][:40], prompts[3][:290]], params)  # cached: 2 blocks of 1, 18 of 3 and 4
    outs = eng.generate(prompts, params)
    assert [outs[i].num_cached_tokens >= hit for i, hit in ((1, 32), (3, 288), (4, 288))] == [True] * 3
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt], device="cuda")  # the mask given: else inferred from the pad id
            gen = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            assert list(out.output_token_ids) == gen[0, len(prompt):].tolist()
    eng.check_integrity()


@pytest.mark.gpu
@pytest.mark.parametrize("name", known_policies())
def test_every_policy_on_cuda_matches_its_cpu_result(tiny, name) -> None:
    """Each KV policy (compressing ones over budget) on CUDA vs CPU, same weights, fp32, torch
    backend for the plain path. Tolerance: the first 8 of 16 greedy tokens are identical and at
    least 12 of 16 positions agree (scores may break near-ties differently on the GPU)."""
    spec = name if not make_policy(name).compresses else f"{name}-40"
    prompt = prompt_of(120, 3)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    runs = {}
    for device in ("cpu", "cuda"):
        eng = engine_on(tiny, "torch", device, kv_pool_bytes=4 << 20, max_num_batched_tokens=64)
        runs[device] = eng.generate([prompt], params, policy=spec)[0].output_token_ids
        eng.check_integrity()
    cpu, cuda = runs["cpu"], runs["cuda"]
    assert cpu[:8] == cuda[:8]
    assert sum(a == b for a, b in zip(cpu, cuda)) >= 12


def test_kvstrata_up_device_option_overrides_the_config(tmp_path, capsys) -> None:
    """``kvstrata up --device`` sets ``node.device`` over the YAML's; a bad value is a usage
    error naming the option (click's BadParameter: exit 2), without pydantic's text."""
    import typer

    pytest.importorskip("pydantic")
    from cli.lifecycle import _up_config

    cfg_file = tmp_path / "kvstrata.yaml"
    cfg_file.write_text("node: {device: cpu, dtype: bfloat16}\n")
    assert _up_config(cfg_file, "", "").node.device == "cpu"
    cfg = _up_config(cfg_file, "", "cuda")
    assert (cfg.node.device, cfg.node.dtype) == ("cuda", "bfloat16")
    with pytest.raises(typer.BadParameter) as exc:
        _up_config(cfg_file, "", "cuda:3")
    assert exc.value.exit_code == 2 and exc.value.param_hint == "'--device'"
    assert exc.value.message.startswith("device must be one of ('auto', 'cpu', 'cuda')")


def test_node_config_carries_the_cuda_step_options_to_the_engine_config() -> None:
    """``node: {cuda_graphs, prefill_graph_max_tokens, fused_kernels}`` in the YAML reach the
    cache node's EngineConfig (the README's way to turn off the GPU paths not yet run on a GPU);
    a negative token count is refused."""
    pytest.importorskip("pydantic")
    pytest.importorskip("zmq")
    from services.cache_node import CacheNode
    from services.config import NodeConfig
    from tests.loop_plane import BLOCK_SIZE, POOL_BLOCKS, block_bytes, tiny_checkpoint

    cfg = NodeConfig(model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE, kv_pool_bytes=POOL_BLOCKS * block_bytes(),
                     host_bytes=0, cuda_graphs=False, prefill_graph_max_tokens=0, fused_kernels=False)
    node = CacheNode("n-cfg", cfg, num_threads=1)
    try:
        engine = node.engine.config
        assert (engine.cuda_graphs, engine.prefill_graph_max_tokens, engine.fused_kernels) == (False, 0, False)
    finally:
        node.shutdown()
    with pytest.raises(ValueError):
        NodeConfig(prefill_graph_max_tokens=-1)
