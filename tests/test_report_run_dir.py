"""Two deepresearch runs writing their reports at the same instant get a folder each
(``workloads.deepresearch.report``): ``reports/deepresearch/<timestamp>`` and
``<timestamp>-<n>``.

Regression (s39): the folder's name was checked free (``exists``) and then created, so two runs
in the same second could both take one name; the second's ``mkdir`` raised FileExistsError
after its whole run, and its report was lost."""

from __future__ import annotations

import multiprocessing
from datetime import datetime
from pathlib import Path
from typing import Any

from workloads.deepresearch.report import _new_run_dir

NOW = datetime(2026, 12, 7, 17, 0, 0)
RUNS, ROUNDS = 4, 40


def _run(root: Path, start: Any, out: Any) -> None:
    """Per round, once every run is at ``start`` (a Barrier): take a run folder for ``NOW`` under
    ``root/<round>``; puts the folders' names, or the error raised, on ``out`` (a Queue)."""
    names = []
    try:
        for round_ in range(ROUNDS):
            start.wait(timeout=30)
            names.append(str(_new_run_dir(root / str(round_), NOW).relative_to(root)))
    except Exception as exc:  # noqa: BLE001 - reported by the test's assert
        names.append(f"{type(exc).__name__}: {exc}")
        start.abort()
    out.put(names)


def test_runs_at_the_same_instant_each_get_their_own_folder(tmp_path: Path) -> None:
    """``RUNS`` processes take a run folder for the same second, released together by a barrier,
    ``ROUNDS`` times: every one gets a folder (before the fix, most rounds ended in
    FileExistsError), each its own, named ``<timestamp>`` then ``<timestamp>-1``, ``-2``..."""
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Barrier(RUNS), ctx.Queue()
    runs = [ctx.Process(target=_run, args=(tmp_path, start, out)) for _ in range(RUNS)]
    for run in runs:
        run.start()
    taken = [out.get(timeout=60) for _ in runs]
    for run in runs:
        run.join(timeout=10)
    errors = [name for names in taken for name in names if "Error" in name]
    assert errors == []
    for round_ in range(ROUNDS):
        got = sorted(names[round_] for names in taken)
        stamp = f"{round_}/deepresearch/20261207-170000"
        assert got == [stamp, *(f"{stamp}-{n}" for n in range(1, RUNS))]
