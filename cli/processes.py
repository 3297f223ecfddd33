"""Stopping local processes picked by their command lines (what ``kvstrata down`` does to the
Ray cluster ``kvstrata up`` started)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import psutil


def stop_processes(matches: Callable[[list[str]], bool], timeout_s: float = 10.0) -> int:
    """Stop every process whose command line ``matches`` accepts, and all their descendants.

    Each gets SIGTERM; those still alive after ``timeout_s`` seconds get SIGKILL. This process
    is never stopped, and processes that vanish or cannot be inspected meanwhile are skipped.
    Returns the number of processes stopped.
    """
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and matches(list(proc.info["cmdline"] or ())):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found.pop(os.getpid(), None)
    procs = list(found.values())
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    return len(procs)
