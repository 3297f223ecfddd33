"""Stopping local processes picked by their command lines (what ``kvstrata down`` does to the
Ray cluster ``kvstrata up`` started)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import psutil

log = logging.getLogger(__name__)

POLL_S = 0.02
"""How often ``stop_processes`` looks whether the processes it signalled have exited."""


def stop_processes(matches: Callable[[list[str]], bool], timeout_s: float = 10.0,
                   last: Callable[[list[str]], bool] | None = None) -> int:
    """Stop every process whose command line ``matches`` accepts, and all their descendants.

    Only this user's processes (real uid) are stopped: another user's process that names the
    same paths is none of ours, and signalling it would fail (review s34 B F5: a process of
    another user naming the cluster's temp dir made ``down`` raise ``AccessDenied`` before it
    had signalled the cluster). Each gets SIGTERM; those still running after ``timeout_s``
    seconds get SIGKILL (and a warning naming them is logged); one that cannot be signalled
    is logged and skipped, the others still stopped. The processes whose command line ``last`` accepts are
    signalled only once all the others have exited (or been killed), with ``timeout_s`` of
    their own: a server its clients talk to while they shut down (Ray's GCS; see
    ``cli.lifecycle._stop_local_ray``). A process counts as exited once it is a zombie: it
    has let go of everything but its process table entry, which its parent (often init, which
    may reap late) clears. This process is never stopped, and processes that vanish or cannot
    be inspected meanwhile are skipped. Returns the number of processes stopped.
    """
    found: dict[int, psutil.Process] = {}
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if proc.pid != os.getpid() and proc.info["uids"] is not None and proc.info["uids"].real == uid \
                    and matches(list(proc.info["cmdline"] or ())):
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True) if _owned_by(child, uid))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    found.pop(os.getpid(), None)
    procs = list(found.values())
    later = [proc for proc in procs if last is not None and _cmdline_matches(proc, last)]
    _terminate([proc for proc in procs if proc not in later], timeout_s)
    _terminate(later, timeout_s)
    return len(procs)


def _owned_by(proc: psutil.Process, uid: int) -> bool:
    """Whether ``proc`` runs as ``uid`` (False once it has vanished or cannot be read: one child
    exiting during the scan skips that child alone, not its siblings; diff review s34 F4)."""
    try:
        return proc.uids().real == uid
    except psutil.Error:
        return False


def _cmdline_matches(proc: psutil.Process, accept: Callable[[list[str]], bool]) -> bool:
    """Whether ``accept`` takes ``proc``'s command line (False once it has vanished)."""
    try:
        return accept(list(proc.cmdline()))
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _terminate(procs: list[psutil.Process], timeout_s: float) -> None:
    """SIGTERM to each of ``procs``; SIGKILL to those still running ``timeout_s`` seconds on."""
    for proc in procs:
        _signal(proc, proc.terminate)
    deadline = time.monotonic() + timeout_s
    alive = procs
    while alive := [proc for proc in alive if not _exited(proc)]:
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    if alive:
        log.warning("%d process(es) still running %.0f s after SIGTERM, killed: %s", len(alive), timeout_s,
                    ", ".join(_describe(proc) for proc in alive))
    for proc in alive:
        _signal(proc, proc.kill)


def _signal(proc: psutil.Process, send: Callable[[], None]) -> None:
    """``send()`` (``proc.terminate`` or ``proc.kill``); a process gone meanwhile is skipped, one
    this user may not signal is logged and skipped (the others are still signalled)."""
    try:
        send()
    except psutil.NoSuchProcess:
        pass
    except psutil.AccessDenied:
        log.warning("not allowed to signal process %s; left running", _describe(proc))


def _exited(proc: psutil.Process) -> bool:
    """True once ``proc`` has exited: reaped (this process's own child is reaped here), gone,
    or a zombie waiting for its parent."""
    try:
        proc.wait(timeout=0)
        return True
    except psutil.TimeoutExpired:
        pass
    except psutil.NoSuchProcess:
        return True
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _describe(proc: psutil.Process) -> str:
    """``pid name`` of ``proc`` for a log line."""
    try:
        return f"{proc.pid} {proc.name()}"
    except psutil.Error:
        return str(proc.pid)
