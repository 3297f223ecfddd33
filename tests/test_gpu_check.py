"""The GPU check's CPU-checkable parts (issue 17): the carry folder, the summary line, and the
GPU test collection on a machine without Ray, pyzmq, gguf or faiss."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

import pytest

from bench import gpu_carry
from bench.gpu_check import (
    SAFE_ENGINE_ARGS,
    StepResult,
    junit_counts,
    last_json,
    safe_engine_step,
    steps,
    summarize,
)
from tests.conftest import OPTIONAL_MODULES

ROOT = Path(__file__).resolve().parent.parent
HIDE = f"import sys\nfor m in {OPTIONAL_MODULES!r}:\n    sys.modules[m] = None\nimport grpc\ngrpc.__version__ = '1.84.0'\n"
"""Python run first in each subprocess below: it makes every module the GPU machine lacks
unimportable, and reports that machine's grpcio version (older than our generated stubs need)."""


def _py(code: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", HIDE + code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                                                "PATH": "/usr/bin:/bin", "KVSTRATA_GPU_CHECK": "1",
                                                # as on CI: no device, whatever this host has (the
                                                # checks count the tests skipped for lack of one)
                                                "CUDA_VISIBLE_DEVICES": ""})


GPU_IMPORTS = ("tests.conftest", "bench.engine", "bench.engine_gpu", "bench.tiers", "bench.tiers_gpu", "bench.gpu_check",
               "bench.gpu_carry", "tests.test_gpu_tiers")
"""What the GPU check imports (its benches, their helpers, the conftest)."""


@dataclass(frozen=True)
class HiddenRun:
    """One subprocess with ``HIDE`` applied: ``GPU_IMPORTS`` imported first, in the fresh
    interpreter (``imports``: "ok" or the traceback's end), then ``pytest -m gpu tests`` run as
    the GPU check runs it (``stdout``'s last line: pytest's summary; ``junit``: its XML)."""

    imports: str
    returncode: int
    stdout: str
    junit: Path


@pytest.fixture(scope="module")
def hidden_run(tmp_path_factory: pytest.TempPathFactory) -> HiddenRun:
    """The three checks below share one subprocess: each spent ~10 s importing torch and
    transformers in a subprocess of its own (the whole collection ~25 s more)."""
    junit = tmp_path_factory.mktemp("gpu-collection") / "j.xml"
    r = _py("import traceback\n"
            f"try:\n    import {', '.join(GPU_IMPORTS)}\n    print('IMPORTS ok', flush=True)\n"
            "except BaseException:\n    print('IMPORTS ' + traceback.format_exc()[-2000:].replace('\\n', ' | '), flush=True)\n"
            "import pytest\nsys.exit(pytest.main(['-q', '-m', 'gpu', '-p', 'no:cacheprovider', '-o', 'addopts=', "
            f"'--junitxml={junit}', 'tests']))")
    first, _, rest = r.stdout.partition("\n")
    assert first.startswith("IMPORTS "), r.stdout[-3000:] + r.stderr[-2000:]
    return HiddenRun(first.removeprefix("IMPORTS "), r.returncode, rest, junit)


def test_gpu_code_and_conftest_import_without_ray_zmq_gguf_faiss(hidden_run: HiddenRun) -> None:
    """Regression: the GPU machine has none of these; nothing the GPU check imports may need them."""
    assert hidden_run.imports == "ok"


def _junit_cases(junit: Path) -> dict[str, str]:
    """Each testcase of a JUnit file (classname.name) -> its skip message and text ("" if not
    skipped)."""
    cases = {}
    for case in ElementTree.parse(junit).iter("testcase"):
        skipped = case.find("skipped")
        cases[f"{case.get('classname')}.{case.get('name')}"] = (
            "" if skipped is None else f"{skipped.get('message', '')} {skipped.text or ''}")
    return cases


def test_gpu_collection_skips_modules_that_need_a_missing_optional_module(hidden_run: HiddenRun) -> None:
    """Regression: ``pytest -m gpu tests`` on the GPU machine must not fail collecting a module
    that imports Ray: conftest reports it skipped (tests/test_tier_ray.py here)."""
    assert hidden_run.returncode in (0, 5), hidden_run.stdout[-3000:]
    assert "error" not in hidden_run.stdout.splitlines()[-1]
    counts = junit_counts(hidden_run.junit)
    assert counts["errors"] == counts["failed"] == 0 and counts["skipped"] >= 1
    tier_ray = [msg for name, msg in _junit_cases(hidden_run.junit).items() if "test_tier_ray" in name]
    assert tier_ray and all("needs ray, not installed here" in msg for msg in tier_ray), tier_ray


def test_whole_gpu_collection_has_no_errors_without_the_modules_the_gpu_machine_lacks(hidden_run: HiddenRun) -> None:
    """Regression: ``pytest -m gpu tests`` as the GPU check runs it, on a machine without
    pydantic, fastapi, uvicorn, grpc_health, openai, ... (the acceptance GPU's image): before,
    21 test modules failed to import there and pytest stopped at collection ("Interrupted: 21
    errors during collection"), so not one GPU test would have run."""
    tail = hidden_run.stdout.splitlines()[-1] if hidden_run.stdout.strip() else ""
    assert hidden_run.returncode == 0, hidden_run.stdout[-3000:]
    assert "error" not in tail and "deselected" in tail, tail
    no_cuda = [name for name, msg in _junit_cases(hidden_run.junit).items() if "needs a CUDA device" in msg]
    assert len(no_cuda) >= 10, tail  # the GPU tests themselves are collected (and skipped: no CUDA here)


def test_carry_folder_holds_tokenizer_and_corpus_without_weights(tmp_path: Path) -> None:
    from cache_node.model_loader import resolve_model_dir
    from workloads.corpus import corpus_path

    files = gpu_carry.build(tmp_path / "carry", resolve_model_dir(), corpus_path())
    assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "tokenizer/config.json",
            str(gpu_carry.CORPUS_REL)} <= set(files)
    assert not any(f.endswith((".safetensors", ".bin", ".gguf")) for f in files)
    assert 5 << 20 < sum(files.values()) <= gpu_carry.MAX_BYTES
    manifest = json.loads((tmp_path / "carry" / "manifest.json").read_text())
    assert set(manifest) == set(files)
    with pytest.raises(ValueError, match="over the"):
        gpu_carry.build(tmp_path / "small", resolve_model_dir(), corpus_path(), max_bytes=1 << 20)
    with pytest.raises(FileNotFoundError):
        gpu_carry.build(tmp_path / "x", tmp_path, corpus_path())


def test_activated_carry_supplies_the_corpus_and_tokenizer(tmp_path: Path) -> None:
    """In a fresh interpreter, the carried corpus file is the one ``corpus_path`` finds."""
    from cache_node.model_loader import resolve_model_dir
    from workloads.corpus import corpus_path

    gpu_carry.build(tmp_path / "carry", resolve_model_dir(), corpus_path())
    r = subprocess.run([sys.executable, "-c", (
        "from bench.gpu_carry import activate, tokenizer_dir\nfrom workloads.corpus import corpus_path, "
        "load_corpus\nfrom transformers import AutoTokenizer\nactivate()\n"
        "print(corpus_path()); print(len(load_corpus()) > 1000)\n"
        "tok = AutoTokenizer.from_pretrained(tokenizer_dir())\n"
        "from bench.common import chat_prompt\nprint(len(chat_prompt(tok, 'hi')) > 3)")],
        check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", gpu_carry.CARRY_ENV: str(tmp_path / "carry")})
    assert r.returncode == 0, r.stderr[-2000:]
    path, big, templated = r.stdout.split()
    assert Path(path) == (tmp_path / "carry" / gpu_carry.CORPUS_REL).resolve() and big == templated == "True"
    with pytest.raises(FileNotFoundError, match="gpu-bundle"):
        gpu_carry.activate(tmp_path / "nowhere")
    importlib.invalidate_caches()


def test_summary_counts_tests_and_merges_targets(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite tests="7" failures="1" errors="0" skipped="2"/></testsuites>')
    tests = junit_counts(xml)
    assert tests == {"passed": 4, "failed": 1, "errors": 0, "skipped": 2, "total": 7}
    assert junit_counts(tmp_path / "none.xml")["missing"] == 1
    engine = last_json('log\n{"not": "last"}\n{"targets_met": {"a": true, "b": false}, "tokens_per_s": {}}\n')
    tiers = {"targets_met": {"c": True}, "restore_over_memcpy": 0.8}
    ok = {n: StepResult(0, 1.0, "") for n in ("pytest", "engine", "tiers")}
    s = summarize(ok, tests, engine, tiers, 12.3)
    assert s["ok"] is False  # one test failed
    assert s["targets_met"] == {"engine.a": True, "engine.b": False, "tiers.c": True}
    assert s["all_targets_met"] is False and s["figures"]["tiers"]["restore_over_memcpy"] == 0.8
    tests["failed"] = 0
    hung = ok | {"tiers": StepResult(None, 100.0, "")}
    s = summarize(hung, tests, engine, None, 200.0)
    assert s["ok"] is False and s["steps"]["tiers"]["timed_out"] is True and s["all_targets_met"] is False
    assert summarize(ok, tests, engine | {"targets_met": {"a": True}}, tiers, 1.0)["all_targets_met"] is True
    assert summarize(ok, tests, engine, tiers, 1.0)["ok"] is True
    assert summarize(ok, tests, engine, tiers | {"errors": {"decode": "RuntimeError: x"}}, 1.0)["ok"] is False
    assert json.loads(json.dumps(s)) == s  # one JSON line
    crashed = ok | {"engine": StepResult(1, 30.0, "Traceback"), "engine_safe": StepResult(0, 100.0, "")}
    s = summarize(crashed, tests, None, tiers, 300.0, engine | {"targets_met": {"a": True}})
    assert s["ok"] is False and s["targets_met"] == {"tiers.c": True, "engine_safe.a": True}
    assert s["all_targets_met"] is False and s["figures"]["engine_safe"]["tokens_per_s"] == {}


def test_gpu_check_steps_fit_the_budget(tmp_path: Path) -> None:
    from bench.gpu_check import BUDGET_S

    plan = steps(tmp_path)
    assert [s.name for s in plan] == ["pytest", "engine", "tiers"]
    assert sum(s.timeout_s for s in plan) <= BUDGET_S < 480
    assert "--device" in plan[1].argv and "cuda" in plan[2].argv
    safe = safe_engine_step(plan)
    assert safe.argv[:len(plan[1].argv)] == plan[1].argv and safe.argv[-4:] == SAFE_ENGINE_ARGS


@pytest.mark.slow
def test_device_engine_bench_runs_end_to_end_on_a_tiny_shape(capsys: pytest.CaptureFixture[str]) -> None:
    """The device bench's whole path (random weights, three systems with EOS ignored, single
    stream, prefix case, roofline) on the CPU with the tiny shape; every system makes exactly
    ``max_tokens`` per request."""
    from bench import engine as bench_engine

    bench_engine.main(["--device", "cpu", "--model-shape", "tiny", "--quick", "--num-requests", "3",
                       "--max-tokens", "5", "--min-prompt-tokens", "32", "--max-prompt-tokens", "64",
                       "--prefix-doc-tokens", "64", "--hf-generate-requests", "1",
                       "--prefill-graph-max-tokens", "0", "--fused-kernels", "0"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["engine_features"] == {"prefill_graph_max_tokens": 0, "fused_kernels": False}
    assert result["mode"] == "device" and result["all_full_length"] is True and result["errors"] == {}
    assert result["generated_tokens"] == {"hf_generate": 5, "hf_continuous_batching": 15, "kvstrata": 15}
    assert set(result["targets_met"]) == {"kvstrata_ge_5x_continuous_batching", "single_stream_ge_100_tok_s",
                                          "prefix_hit_ttft_le_0.1x_cold"}
    assert 0 < result["roofline_fraction"]["batch"] and result["single_stream"]["decode_tokens_per_s"] > 0
    prof = result["profile"]  # where a step's time goes: the phases ran and were timed
    assert prof["decode_batch"]["batch"] == 3 and prof["decode_batch"]["steps"] == 20
    assert prof["decode_single"]["phases"]["sample"]["calls"] == 20
    assert prof["prefix_hit"]["ttft_ms"] > 0 and prof["prefix_hit"]["phases"]["runner.execute"]["calls"] >= 1
    assert result["kvstrata_steps"]["steps"] > 0
    assert result["kvstrata_steps"]["prefill_graph_buckets"] is None  # CPU: no graphs
    assert result["prefix_hit_ttft_ratio_eager"] is None  # no prefill graphs to turn off


@pytest.mark.slow
def test_device_tier_bench_runs_end_to_end_on_a_tiny_shape() -> None:
    from bench.tiers_gpu import run_device

    result = run_device("cpu", "tiny", True, demote_bytes=1 << 20)
    assert result["restore_bytes"] > 0 and result["restore_gbps"] > 0 and result["pinned_memcpy_gbps"] > 0
    decode = result["decode_step_ms"]
    assert decode["demoted_bytes"] >= 1 << 19 and decode["steps_with"] >= 3 and decode["without_ms"] > 0
    assert result["errors"] == {}
    assert set(result["targets_met"]) == {"restore_ge_0.7_memcpy", "decode_with_demotion_within_10pct"}


def test_device_result_from_a_partial_run_leaves_unjudged_targets_unmet() -> None:
    """Regression: one system failing on the GPU lost every figure of the run; now the others
    are reported, ratios without inputs are None and their targets are not met."""
    from bench.engine_gpu import GpuBenchConfig, device_result

    cfg = GpuBenchConfig(num_requests=2, max_tokens=3)
    r = device_result({"kvstrata": [[1, 2, 3], [4, 5, 6]]}, {"kvstrata": 0.5}, [[1] * 300, [2] * 400],
                      {"decode_tokens_per_s": 150.0, "ttft_s": 0.01}, None, 4_800_000_000, cfg)
    assert r["tokens_per_s"] == {"kvstrata": 12.0} and r["speedup_vs_hf_continuous_batching"] is None
    assert r["prefix_hit_ttft_ratio"] is None and r["roofline_fraction"]["single"] == pytest.approx(0.15)
    assert r["targets_met"] == {"kvstrata_ge_5x_continuous_batching": False, "single_stream_ge_100_tok_s": True,
                                "prefix_hit_ttft_le_0.1x_cold": False}
    assert json.loads(json.dumps(r, allow_nan=False)) == r


def test_device_result_reports_the_eager_prefix_case_beside_the_judged_one() -> None:
    """The prefix case runs twice on the GPU, with prefill graphs and without; only the first
    is judged against the 0.1x target."""
    from bench.engine_gpu import GpuBenchConfig, device_result
    from bench.engine_systems import PrefixCase

    cfg = GpuBenchConfig(num_requests=2, max_tokens=3)
    graphs = PrefixCase(2074, [0.08], [0.006, 0.007, 0.009], [2064] * 3)
    eager = PrefixCase(2074, [0.08], [0.02, 0.024, 0.03], [2064] * 3)
    r = device_result({"kvstrata": [[1, 2, 3]]}, {"kvstrata": 0.5}, [[1] * 300], None, graphs,
                      4_800_000_000, cfg, eager)
    assert r["prefix_hit_ttft_ratio"] == pytest.approx(0.0875)
    assert r["prefix_hit_ttft_eager_s"] == pytest.approx(0.024)
    assert r["prefix_hit_ttft_ratio_eager"] == pytest.approx(0.3)
    assert r["targets_met"]["prefix_hit_ttft_le_0.1x_cold"] is True
    assert json.loads(json.dumps(r, allow_nan=False)) == r
