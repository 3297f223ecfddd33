"""NVIDIA kvpress side by side with kvstrata's policies: the same model, prompts and ratios.

kvpress 0.5.5 pins ``transformers<5.3`` and kvstrata runs 5.24, so the peer lives in its own
virtual environment (``.venv-kvpress``, created on first use) and runs as a subprocess::

    parent (kvstrata venv)                      child (.venv-kvpress)
    ensure_env() -> start(job) ---- job.json --> python bench/kvpress_peer.py job.json
    collect(proc) <--------- last stdout line: {"rows": {spec: {metric: [values]}},
                                                "rows_by_length": {length: {spec: ...}}, ...}

The child imports nothing from kvstrata. It loads the same checkpoint directory the engine
uses (``cache_node.model_loader.cache_dir()/smollm2-135m-instruct``), prefills each context
once under a press (kvpress compresses during prefill only, question-agnostic, like
``bench.quality``'s compress-once-ask-many), then teacher-forces each question plus the full
cache's greedy answer with the answer's true positions. Metrics match ``bench.quality``:
KL(full || press) and greedy agreement along the answer, passkey/needle accuracy (answer
tokens all argmax-equal to the full cache's, only items the full cache answers), perplexity
of held-out text, and ``device_bytes_ratio`` = bytes the cache tensors really hold after the
press / bytes of the full cache. Scorer presses gather the kept tokens, so they really shrink
the cache; head-wise presses (``AdaKVPress``) only mask, so they hold the full cache's bytes
and report 1.0.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

KVPRESS_VERSION = "0.5.5"
TRANSFORMERS_VERSION = "5.2.0"  # newest release kvpress 0.5.5 accepts (<5.3)
TORCH_VERSION = "2.13.0"  # the local CPU wheel; an unpinned torch pulls CUDA wheels
ENV_DIR = ".venv-kvpress"
PRESSES = ("snapkv", "streaming", "tova", "keydiff", "expected_attention")
PRESSES_FULL = (*PRESSES, "adakv_snapkv")


class PeerUnavailable(RuntimeError):
    """kvpress could not be installed or run here (the message carries the error)."""


# ---- parent side (kvstrata venv) ------------------------------------------------------------
def ensure_env(root: Path, log: Path | None = None) -> Path:
    """Create ``root/.venv-kvpress`` with pinned kvpress once; return its python.

    Idempotent: a stamp file naming the pinned versions marks a finished install.
    Raises PeerUnavailable with the installer's last output when an install step fails.
    """
    env = root / ENV_DIR
    python = env / "bin" / "python"
    stamp = env / f".kvpress-{KVPRESS_VERSION}-transformers-{TRANSFORMERS_VERSION}"
    if stamp.exists() and python.exists():
        return python
    steps = [
        [sys.executable, "-m", "venv", str(env)],
        [str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
        [str(python), "-m", "pip", "install", "-q", f"kvpress=={KVPRESS_VERSION}",
         f"transformers=={TRANSFORMERS_VERSION}"],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if log is not None:
            with log.open("a") as f:
                f.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        if done.returncode != 0:
            raise PeerUnavailable(f"`{' '.join(cmd[-3:])}` failed: {(done.stderr or done.stdout)[-800:]}")
    stamp.touch()
    return python


def start(root: Path, job: dict[str, Any]) -> tuple[subprocess.Popen, Path]:
    """Run the peer on ``job`` in the background. Returns (process, its stderr log path)."""
    python = ensure_env(root)
    tmp = Path(tempfile.mkdtemp(prefix="kvpress-peer-"))
    (tmp / "job.json").write_text(json.dumps(job))
    err = tmp / "stderr.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([str(python), str(Path(__file__).resolve()), str(tmp / "job.json")],
                            stdout=subprocess.PIPE, stderr=err.open("w"), text=True, env=env)
    return proc, err


def collect(proc: subprocess.Popen, err: Path, timeout_s: float = 1800) -> dict[str, Any]:
    """Wait for the peer; its parsed last stdout line. Raises PeerUnavailable on failure."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        proc.kill()
        raise PeerUnavailable(f"kvpress peer ran past {timeout_s:.0f} s") from exc
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise PeerUnavailable(f"kvpress peer exited {proc.returncode}: {err.read_text()[-1500:]}")
    return json.loads(lines[-1])


# ---- child side (kvpress venv) --------------------------------------------------------------
def make_press(name: str, keep_ratio: float) -> Any:
    """The kvpress press ``name`` keeping ``keep_ratio`` of the context (kvpress defaults)."""
    import kvpress

    ratio = 1.0 - keep_ratio  # kvpress's compression_ratio is the fraction removed
    classes = {
        "snapkv": kvpress.SnapKVPress, "streaming": kvpress.StreamingLLMPress,
        "tova": kvpress.TOVAPress, "keydiff": kvpress.KeyDiffPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
    }
    if name == "adakv_snapkv":
        return kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio))
    if name not in classes:
        raise ValueError(f"unknown press {name!r}; known: {sorted(classes) + ['adakv_snapkv']}")
    return classes[name](compression_ratio=ratio)


def cache_bytes(cache: Any) -> int:
    """Bytes the cache's key/value tensors hold (masked entries included: they are held)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


class Runner:
    """Prefill/force helpers over one HF model (batch 1)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def prefill(self, context: list[int], press: Any) -> Any:
        import torch
        from transformers import DynamicCache

        cache = DynamicCache()
        with press(self.model) if press is not None else contextlib.nullcontext(), torch.no_grad():
            self.model.model(input_ids=torch.tensor([context]), past_key_values=cache)
        return cache

    def force(self, cache: Any, tokens: list[int], start: int) -> Any:
        """(len(tokens), V) logits of ``tokens`` at positions [start, ...); the cache is left as
        it was (the appended entries are cut off again)."""
        import torch

        lengths = [layer.keys.shape[2] for layer in cache.layers]
        pos = torch.arange(start, start + len(tokens)).unsqueeze(0)
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([tokens]), past_key_values=cache, position_ids=pos)
        for layer, n in zip(cache.layers, lengths):
            layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        return out.logits[0].float()


def evaluate_item(runner: Runner, item: dict, specs: list[tuple[str, str, float]], rows: dict) -> None:
    import torch

    n = len(item["context"])
    full = runner.prefill(item["context"], None)
    full_bytes = cache_bytes(full)
    refs = []
    for q in item["questions"]:
        logits = runner.force(full, q["prompt"] + q["gen"], n)[len(q["prompt"]) - 1 :]
        refs.append((q, logits))
        if q["gen"]:  # an empty answer (the engine stopped at once) has no tokens to agree on
            rows["_reference"]["agree_engine"].append(
                float((logits[: len(q["gen"])].argmax(-1) == torch.tensor(q["gen"])).float().mean()))
    held, targets = item["held"], torch.tensor(item["held"][1:])
    held_ref = runner.force(full, held, n)
    del full
    for spec, name, keep in specs:
        cache = runner.prefill(item["context"], make_press(name, keep))
        row = rows[spec]
        row["device_bytes_ratio"].append(cache_bytes(cache) / full_bytes)
        for q, ref in refs:
            got = runner.force(cache, q["prompt"] + q["gen"], n)[len(q["prompt"]) - 1 :]
            lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
            kl = (lp.exp() * (lp - lq)).sum(-1)
            row["kl"].append(float(kl.mean()))
            row["agree"].append(float((ref.argmax(-1) == got.argmax(-1)).float().mean()))
            row["peak_ratio"].append(row["device_bytes_ratio"][-1])
            need = q["need"]
            if need is not None:
                row["kl_answer"].append(float(kl[:need].mean()))
            if q["full_ok"] and need is not None:
                ok = bool((ref[:need].argmax(-1) == got[:need].argmax(-1)).all())
                row[f"acc_{q['kind']}"].append(float(ok))
        got = runner.force(cache, held, n)
        row["nll"].append(float(torch.nn.functional.cross_entropy(got[:-1], targets)))
        row["nll_full"].append(float(torch.nn.functional.cross_entropy(held_ref[:-1], targets)))


def best_press(rows: dict, budget: float) -> str | None:
    """The press spec at ``budget`` with the highest passkey accuracy, then the lowest mean KL."""
    def mean(xs: list[float], empty: float) -> float:
        return sum(xs) / len(xs) if xs else empty

    cands = [s for s in rows if s.startswith("kvpress.") and s.endswith(f"-{budget:g}")]
    return max(cands, key=lambda s: (mean(rows[s]["acc_passkey"], 0.0), -mean(rows[s]["kl"], 1e9)), default=None)


def trace_press(runner: Runner, spec: str, document: list[int], step: int) -> list[tuple[int, int]]:
    """(tokens, cache bytes) after a prefill of ``document``'s first ``step``, ``2 step``, ...
    tokens (and all of it) under press ``spec`` ("kvpress.<name>-<keep ratio>"): kvpress
    compresses each prefill once, so this is what one request of that length holds."""
    name, keep = spec.removeprefix("kvpress.").rsplit("-", 1)
    ends = sorted({*range(step, len(document), step), len(document)})
    return [(n, cache_bytes(runner.prefill(document[:n], make_press(name, float(keep))))) for n in ends]


def child_main(job_path: str) -> None:
    import time
    from collections import defaultdict

    import kvpress
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    job = json.loads(Path(job_path).read_text())
    torch.manual_seed(0)
    torch.set_num_threads(int(job.get("threads", 1)))
    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    runner = Runner(model)
    specs = [(f"kvpress.{p}-{b:g}", p, b) for p in job["presses"] for b in job["budgets"]]
    rows: dict = defaultdict(lambda: defaultdict(list))
    by_length: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    t0 = time.perf_counter()
    for item in job["items"]:
        one: dict = defaultdict(lambda: defaultdict(list))
        evaluate_item(runner, item, specs, one)
        for dst in (rows, by_length[item.get("length", len(item["context"]))]):
            for spec, metrics in one.items():
                for key, values in metrics.items():
                    dst[spec][key].extend(values)
    trace, job_trace = None, job.get("trace")
    best = best_press(rows, job_trace["budget"]) if job_trace else None
    if best is not None:
        trace = {"press": best, "points": trace_press(runner, best, job_trace["document"], job_trace["step"])}
    print(json.dumps({
        "rows": rows, "rows_by_length": by_length, "seconds": time.perf_counter() - t0, "trace": trace,
        "versions": {"kvpress": getattr(kvpress, "__version__", KVPRESS_VERSION),
                     "transformers": transformers.__version__, "torch": torch.__version__},
    }))


if __name__ == "__main__":
    child_main(sys.argv[1])
