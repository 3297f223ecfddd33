"""The one prepared GPU check of issue 17 (``make gpu-check``), run on the acceptance GPU.

``python3 -m bench.gpu_check`` from the repository root (no venv, no install, no Ray needed)
runs three steps, each a subprocess with its own timeout (so one hang cannot eat the
budget; the whole run stays under ``BUDGET_S``):

1. ``pytest -m gpu tests`` (JUnit XML kept; test modules that need a module the GPU machine
   lacks, ``OPTIONAL_MODULES``, are skipped at collection by ``tests/conftest.py``);
2. ``bench.engine --device cuda --model-shape llama-3.1-8b --quick``;
3. ``bench.tiers --device cuda --quick``;
4. only when step 2 crashed (printed no JSON) and time is left: step 2 again without fused
   kernels and prefill graphs (``engine_safe``), so one broken part costs not every figure.

Everything lands in ``$OUT`` (default ``./gpu-check-out``): ``gpu-check.log`` (every step's
output), ``<step>.log``, ``pytest-gpu.xml``, ``engine.json``, ``tiers.json`` and
``summary.json``. The last stdout line is the summary as one JSON object: pass/fail counts,
each step's exit status and seconds, the key figures, ``targets_met`` (every target of both
benches) and ``ok`` (every step exited 0, no test failed, no bench part raised). The tokenizer and the corpus
come from ``$KVSTRATA_GPU_CARRY`` (default ``.gpu-carry``, built by ``make gpu-bundle``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUDGET_S = 470.0
"""Whole-run limit (seconds): under the 8 minutes the issue allows."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: tuple[str, ...]
    timeout_s: float
    json_out: str | None  # where the step's last JSON line is saved


def steps(out: Path) -> list[Step]:
    py = sys.executable
    return [
        Step("pytest", (py, "-m", "pytest", "-m", "gpu", "-v", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=",
                        "--timeout", "120", "--continue-on-collection-errors", f"--junitxml={out / 'pytest-gpu.xml'}", "tests"), 200.0, None),
        Step("engine", (py, "-m", "bench.engine", "--device", "cuda", "--model-shape", "llama-3.1-8b",
                        "--quick"), 180.0, "engine.json"),
        Step("tiers", (py, "-m", "bench.tiers", "--device", "cuda", "--quick"), 90.0, "tiers.json"),
    ]


SAFE_ENGINE_ARGS = ("--fused-kernels", "0", "--prefill-graph-max-tokens", "0")
"""The engine step again without the parts first run on the device in this check (fused Triton
kernels, prefill CUDA graphs): ``engine_safe``, run only when the engine step printed no JSON
(a crash) and ``SAFE_ENGINE_MIN_S`` of the budget are left, so one broken part does not cost
the run every engine figure."""
SAFE_ENGINE_MIN_S = 100.0


def safe_engine_step(plan: list[Step]) -> Step:
    """``plan``'s engine step with ``SAFE_ENGINE_ARGS``, its JSON saved as ``engine-safe.json``."""
    engine = next(s for s in plan if s.name == "engine")
    return Step("engine_safe", engine.argv + SAFE_ENGINE_ARGS, engine.timeout_s, "engine-safe.json")


@dataclass
class StepResult:
    rc: int | None  # None: timed out
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.rc is None


def run_step(step: Step, timeout_s: float, env: dict[str, str], log: Path, cwd: Path) -> StepResult:
    """Run ``step`` in ``cwd`` in its own process group, killed as a group at ``timeout_s``."""
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return StepResult(rc, time.monotonic() - t0, log.read_text(errors="replace"))


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that parses as a JSON object, else None."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(value, dict):
                return value
    return None


def junit_counts(path: Path) -> dict[str, int]:
    """passed/failed/errors/skipped/total over every ``testsuite`` of a JUnit XML file (zeros
    and ``missing: 1`` when the file is absent or unreadable)."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "total": 0}
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return counts | {"missing": 1}
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    for s in suites:
        counts["total"] += int(s.get("tests", 0))
        counts["failed"] += int(s.get("failures", 0))
        counts["errors"] += int(s.get("errors", 0))
        counts["skipped"] += int(s.get("skipped", 0))
    counts["passed"] = counts["total"] - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def summarize(results: dict[str, StepResult], tests: dict[str, int], engine: dict[str, Any] | None,
              tiers: dict[str, Any] | None, seconds: float,
              engine_safe: dict[str, Any] | None = None) -> dict[str, Any]:
    """The final summary line (pure: tested on the CPU). ``engine_safe``: the engine step's
    rerun without fused kernels and prefill graphs, when the engine step crashed; its figures
    and targets are reported under ``engine_safe``, and ``ok`` stays false (a step failed)."""
    targets: dict[str, bool] = {}
    for name, res in (("engine", engine), ("tiers", tiers), ("engine_safe", engine_safe)):
        for key, met in ((res or {}).get("targets_met") or {}).items():
            targets[f"{name}.{key}"] = bool(met)
    figures: dict[str, Any] = {}
    for name, res in (("engine", engine), ("engine_safe", engine_safe)):
        if res:
            figures[name] = {k: res.get(k) for k in (
                "tokens_per_s", "speedup_vs_hf_continuous_batching", "prefix_hit_ttft_ratio",
                "prefix_hit_ttft_ratio_eager", "prefix_cold_ttft_s", "prefix_hit_ttft_s", "roofline_fraction",
                "all_full_length", "prompt_tokens", "errors")}
            figures[name]["single_stream"] = res.get("single_stream")
    if tiers:
        figures["tiers"] = {k: tiers.get(k) for k in (
            "restore_gbps", "pinned_memcpy_gbps", "restore_over_memcpy", "decode_with_over_without")}
    ok = (all(r.rc == 0 for r in results.values()) and tests.get("failed", 1) == 0
          and tests.get("errors", 1) == 0 and not tests.get("missing")
          and not (engine or {}).get("errors") and not (tiers or {}).get("errors"))
    return {
        "gpu_check": "issue-17", "ok": ok, "seconds": round(seconds, 1), "tests": tests,
        "steps": {n: {"rc": r.rc, "timed_out": r.timed_out, "seconds": round(r.seconds, 1)}
                  for n, r in results.items()},
        "figures": figures, "targets_met": targets,
        "all_targets_met": (bool(targets) and all(targets.values()) and engine is not None and tiers is not None
                            and engine_safe is None),
    }


def machine() -> dict[str, Any]:
    """torch, transformers and triton versions and the CUDA device's name (what is importable)."""
    info: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "triton"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            info[name] = f"unavailable: {type(exc).__name__}"
    try:
        import torch

        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        info["device"] = f"unavailable: {type(exc).__name__}"
    return info


def _env(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")  # a step killed at its timeout keeps its log
    env["KVSTRATA_GPU_CHECK"] = "1"  # tests/conftest.py: skip modules whose gRPC stubs refuse its grpcio
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("KVSTRATA_GPU_CARRY", str(root / ".gpu-carry"))
    return env


def main() -> int:
    root = Path(__file__).resolve().parent.parent
    out = Path(os.environ.get("OUT") or "gpu-check-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    env, t0, results = _env(root), time.monotonic(), {}
    with open(out / "gpu-check.log", "w") as log:
        plan = steps(out)
        for step in [*plan, safe_engine_step(plan)]:
            left = BUDGET_S - (time.monotonic() - t0) - 5
            if step.name == "engine_safe" and (last_json(results["engine"].output) is not None
                                               or left < SAFE_ENGINE_MIN_S):
                continue
            res = run_step(step, min(step.timeout_s, left), env, out / f"{step.name}.log", root)
            results[step.name] = res
            log.write(f"==== {step.name}: rc={res.rc} {res.seconds:.1f}s: {' '.join(step.argv)}\n{res.output}\n")
            log.flush()
            if step.json_out and (value := last_json(res.output)) is not None:
                (out / step.json_out).write_text(json.dumps(value, indent=1, sort_keys=True))
    engine = last_json(results["engine"].output)
    tiers = last_json(results["tiers"].output)
    safe = last_json(results["engine_safe"].output) if "engine_safe" in results else None
    summary = summarize(results, junit_counts(out / "pytest-gpu.xml"), engine, tiers, time.monotonic() - t0, safe)
    summary["machine"] = machine()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    print(json.dumps(summary, sort_keys=True), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
