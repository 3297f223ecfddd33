"""Where an engine step's time goes on the device (issue 17's GPU bench, ``profile`` part).

Three windows on the bench's own engine, each after its warm-up: a full decode batch (every
bench prompt decoding), one decoding stream, and one prefix-hit request (its TTFT step). In each,
``PhaseTimer`` records the wall time of the engine's step phases (scheduling, the forward
pass, sampling; the forward's device time too, from CUDA events), and the decode-batch window
also runs under ``torch.profiler``, whose top operators (by host and by device time) go to
stderr. The JSON goes in the bench result under ``profile``: per window, ``step_ms`` (median
wall time of a step) and per phase ``calls``/``ms_per_call``.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import Self  # typing.Self needs Python 3.11; the project allows 3.10

import cache_node.engine as engine_module
from bench.common import median
from cache_node.engine import LLMEngine
from cache_node.sampling_params import SamplingParams

PHASES = ("_settle_finished_turns", "_release_idle_sessions", "_schedule", "_execute")
"""``LLMEngine`` methods timed (``_execute`` holds the forward pass and the sampling)."""


class PhaseTimer:
    """Wall time of ``PHASES``, of ``runner.execute`` (with its device time from CUDA events
    on CUDA) and of the sampler's ``draw`` (label "sample") while installed (``with``);
    ``steps`` holds each step's wall time (seconds) when the caller steps through ``step``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.wall: dict[str, list[float]] = defaultdict(list)
        self.device_ms: list[float] = []
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._undo: list[Callable[[], None]] = []
        self.steps: list[float] = []

    def _wrap(self, owner: Any, name: str, label: str, events: bool = False) -> None:
        inner = getattr(owner, name)
        cuda = events and self.engine.runner.device.type == "cuda"

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            out = inner(*args, **kwargs)
            if cuda:
                end.record()
                self._events.append((start, end))
            self.wall[label].append(time.perf_counter() - t0)
            return out
        setattr(owner, name, timed)
        if owner is engine_module:
            self._undo.append(lambda: setattr(owner, name, inner))
        else:
            self._undo.append(lambda: delattr(owner, name))  # the class's method again

    def __enter__(self) -> Self:
        for name in PHASES:
            self._wrap(self.engine, name, name.lstrip("_"))
        self._wrap(self.engine.runner, "execute", "runner.execute", events=True)
        self._wrap(engine_module, "draw", "sample")
        return self

    def __exit__(self, *exc: object) -> None:
        for undo in reversed(self._undo):
            undo()
        if self._events:
            torch.cuda.synchronize()
            self.device_ms = [s.elapsed_time(e) for s, e in self._events]

    def step(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        self.steps.append(time.perf_counter() - t0)

    def summary(self) -> dict[str, Any]:
        phases = {k: {"calls": len(v), "ms_per_call": round(1000 * sum(v) / len(v), 3)} for k, v in self.wall.items()}
        out: dict[str, Any] = {"steps": len(self.steps),
                               "step_ms": round(1000 * median(self.steps), 3) if self.steps else None,
                               "phases": phases}
        if self.device_ms:
            out["forward_device_ms"] = round(median(self.device_ms), 3)
        return out


def _top_ops(prof: Any, key: str, rows: int = 20) -> str:
    try:
        return prof.key_averages().table(sort_by=key, row_limit=rows)
    except Exception as exc:  # noqa: BLE001 - a profiler version without this key
        return f"(no table by {key}: {type(exc).__name__}: {exc})"


def _profiler(engine: LLMEngine) -> Any:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def _drain(engine: LLMEngine) -> None:
    for seq_id in list(engine.requests):
        engine.abort_request(seq_id)
    while engine.has_unfinished_requests():
        engine.step()


def _decode_window(engine: LLMEngine, prompts: list[list[int]], steps: int, namespace: str,
                   profiler: bool) -> dict[str, Any]:
    params = SamplingParams(max_tokens=steps + 16, ignore_eos=True)
    ids = [engine.add_request(p, params, cache_namespace=namespace) for p in prompts]
    while any(not engine.requests[i].output_token_ids for i in ids):
        engine.step()
    for _ in range(3):  # past the first decode steps
        engine.step()
    timer = PhaseTimer(engine)
    if profiler:
        with _profiler(engine) as prof, timer:
            for _ in range(steps):
                timer.step()
        print(f"[profile] decode batch of {len(prompts)}, {steps} steps: top operators by host time\n"
              f"{_top_ops(prof, 'self_cpu_time_total')}\n[profile] by device time\n"
              f"{_top_ops(prof, 'self_device_time_total')}", file=sys.stderr, flush=True)
    else:
        with timer:
            for _ in range(steps):
                timer.step()
    _drain(engine)
    return timer.summary() | {"batch": len(prompts)}


def _prefix_hit_window(engine: LLMEngine, cold: list[int], hit: list[int]) -> dict[str, Any]:
    """A cold request on ``cold``, then ``hit`` (the same document, another question: a prefix
    hit), alone; the hit's steps (one request, one token: its TTFT) are timed."""
    params = SamplingParams(max_tokens=1)
    namespace = f"profile-prefix-{time.monotonic_ns()}"
    engine.generate([cold], params, cache_namespace=namespace)
    timer = PhaseTimer(engine)
    with _profiler(engine) as prof, timer:
        engine.add_request(hit, params, cache_namespace=namespace)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            timer.step()
        ttft = time.perf_counter() - t0
    print(f"[profile] prefix hit ({len(hit)} tokens): top operators by host time\n"
          f"{_top_ops(prof, 'self_cpu_time_total')}\n[profile] by device time\n"
          f"{_top_ops(prof, 'self_device_time_total')}", file=sys.stderr, flush=True)
    return timer.summary() | {"prompt_tokens": len(hit), "ttft_ms": round(1000 * ttft, 3)}


def profile_engine(engine: LLMEngine, prompts: list[list[int]], prefix_prompts: tuple[list[int], list[int]],
                   steps: int = 20) -> dict[str, Any]:
    """The three windows (module docstring) on an idle ``engine``; leaves it idle."""
    return {
        "decode_batch": _decode_window(engine, prompts, steps, "profile-batch", profiler=True),
        "decode_single": _decode_window(engine, prompts[:1], steps, "profile-single", profiler=False),
        "prefix_hit": _prefix_hit_window(engine, *prefix_prompts),
    }
