"""Peers of a restartable actor passed by name, not by handle.

Ray counts an actor handle inside an actor's constructor arguments as an object-store
reference owned by the creating driver; for an actor with ``max_restarts != 0`` it then logs,
at error level, once per driver (``core_worker.cc``): "Actor ... has constructor arguments in
the object store and max_restarts > 0. If the arguments in the object store go out of scope
or are lost, the actor restart will fail" (ray-project/ray#53727). Every ``make demo`` printed
it for the SpillNode, the first restartable actor the launcher creates with a handle (the
GlobalScheduler's, for its block events).

An :class:`ActorRef` (name and namespace) keeps the constructor arguments plain values: the
actor looks its peers up itself (``ray.get_actor``), on its first start and on each restart,
so a restart never depends on references the creating driver owned.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActorRef:
    """A named actor: ``name`` in Ray namespace ``namespace``."""

    name: str
    namespace: str

    def resolve(self) -> Any:
        """The actor's handle.

        Raises:
            ValueError: no live actor of that name in that namespace (Ray's error).
        """
        return ray.get_actor(self.name, namespace=self.namespace)


def resolve(peer: Any) -> Any:
    """``peer`` looked up when it is an :class:`ActorRef`, else ``peer`` itself (a handle, or
    None)."""
    return peer.resolve() if isinstance(peer, ActorRef) else peer


def resolve_or_none(peer: Any) -> Any:
    """``resolve(peer)``, but None when ``peer`` is an :class:`ActorRef` with no live actor of
    its name (a spill node dead for good that the global scheduler has not created again yet:
    ``services.spill_recreate``)."""
    try:
        return resolve(peer)
    except ValueError:
        return None


class NamedPeer:
    """A peer actor held by name (``ActorRef``), its handle looked up on use, for a restartable
    actor that must start while the peer has no live actor (the global scheduler dead for good
    and not created again yet: its constructor must not raise, or Ray never restarts it).

    ``handle()`` is the last look-up's handle, looked up again once ``relookup_s`` passed since
    it (a peer created again under its name is a new actor: a fire-and-forget call to the old
    handle would fail unseen), None while no live actor has the name; ``missing`` says why
    ("" once found). A look-up that fails otherwise (the GCS slow or unreachable: Ray's
    ``GetTimeoutError``, ``RpcError``, ...) is no answer: the last handle stays (None, with
    ``missing`` naming the failure, when none was found yet) and ``handle()`` never raises. A
    handle (not an ``ActorRef``) is used as it is. Thread-safe.

    Regression (s39 review r1): only "no such actor" (ValueError) was caught, so any other
    failed look-up raised out of ``handle()`` into its callers: a cache node's step thread,
    telling the scheduler of expired sessions, failed the node for it (its step loop ended),
    and the node's constructor raised (Ray restarts no such actor).
    """

    def __init__(self, peer: Any, relookup_s: float = 5.0, clock: Any = time.monotonic) -> None:
        self.peer, self.relookup_s, self._clock = peer, relookup_s, clock
        self._lock = threading.Lock()
        self._handle: Any = None
        self._looked_at: float | None = None
        self._looking = False
        self.missing = ""

    def missing_now(self) -> str:
        """``missing`` as of the last look-up, without blocking (for an event loop: a node's
        ``stats``); when a look-up is due (``relookup_s`` passed), one runs on a background
        thread, its answer read by a later call.

        Regression (s39 review r1): a cache node's ``stats`` asked ``handle()`` on its event
        loop, which blocks for a GCS call (up to Ray's GCS timeout when the GCS hangs), and
        behind the step thread's own look-up (the same lock)."""
        if isinstance(self.peer, ActorRef) and not self._looking and (
                self._looked_at is None or self._clock() - self._looked_at >= self.relookup_s):
            self._looking = True
            threading.Thread(target=self._look_up, name=f"kvstrata-lookup-{self.peer.name}", daemon=True).start()
        return self.missing

    def _look_up(self) -> None:
        try:
            self.handle()
        finally:
            self._looking = False

    def forget(self, handle: Any) -> None:
        """A call to ``handle`` failed as its actor died (or Ray is restarting it): the next
        ``handle()`` looks the name up again at once, not ``relookup_s`` after the last look-up
        (a new actor of the name gets the calls that follow). Nothing when a later look-up
        found another handle meanwhile, or for a handle given as it is. ``PeerOutbox`` calls it.

        Regression (s40): calls to a peer that died after it was found went to the dead actor,
        lost unseen, until the next look-up (up to ``relookup_s``)."""
        with self._lock:
            if isinstance(self.peer, ActorRef) and handle is self._handle:
                self._looked_at = None

    def handle(self) -> Any:
        """The peer's handle, or None while no live actor has its name (or none was found yet
        and the look-up fails). Never raises; blocks for a look-up (one GCS call) at most once
        per ``relookup_s``."""
        if not isinstance(self.peer, ActorRef):
            return self.peer
        with self._lock:
            now = self._clock()
            if self._looked_at is not None and now - self._looked_at < self.relookup_s:
                return self._handle
            self._looked_at = now
            try:
                self._handle = self.peer.resolve()
                if self.missing:
                    log.warning("actor %s is back: its calls go to it again", self.peer.name)
                self.missing = ""
            except ValueError as exc:  # (Ray's: no live actor of that name)
                if not self.missing:
                    log.warning("no live actor named %s in namespace %s: its calls are skipped until it is "
                                "back (looked up every %g s)", self.peer.name, self.peer.namespace, self.relookup_s)
                self._handle = None
                self.missing = (f"no live actor named {self.peer.name} (looked up again every {self.relookup_s:g} "
                                f"s): {str(exc).strip()[:200]}")
            except Exception as exc:  # noqa: BLE001 - the look-up failed: no answer, the last handle kept
                log.warning("looking up actor %s in namespace %s failed (%s; %s): %s: %.200s", self.peer.name,
                            self.peer.namespace, "its last handle kept" if self._handle is not None else "none found yet",
                            f"tried again in {self.relookup_s:g} s", type(exc).__name__, exc)
                if self._handle is None:
                    self.missing = (f"looking up {self.peer.name} failed (tried again every {self.relookup_s:g} s): "
                                    f"{type(exc).__name__}: {str(exc).strip()[:200]}")
            return self._handle


def actor_restarts() -> int:
    """How often Ray restarted the current actor: 0 for a first start and outside an actor;
    its GCS record's count after a restart (1 when that record is unreadable)."""
    context = ray.get_runtime_context()
    actor_id = context.get_actor_id()
    if actor_id is None or not context.was_current_actor_reconstructed:
        return 0
    try:
        from ray._private import state  # no public API reads an actor's restart count

        return max(1, int(state.actors(actor_id).get("NumRestarts", 1)))
    except Exception:  # noqa: BLE001 - an internal API: fall back to the public flag
        return 1


def kill_gone(name: str, namespace: str, timeout_s: float) -> bool:
    """Kill actor ``name`` of ``namespace`` and wait (up to ``timeout_s``) until its worker
    process has exited; True then, or when no actor has that name; False at ``timeout_s`` (its
    process may still run). ``kvstrata down`` and the launcher kill the global scheduler so
    before the spill nodes, which its spill watch creates again (``services.spill_recreate``).

    Ray lists the actor DEAD (``ray.get_actor`` raises) as soon as ``ray.kill`` returns, while
    its process may run on: a stopped (``SIGSTOP``) or busy one until Ray force-kills it,
    about 5 s later, and its threads (the spill watch) run on meanwhile once it goes on. So the
    wait is for the raylet's word that the worker is gone (the GCS worker table's ``is_alive``,
    set false when the worker's connection to its raylet closed) and, for an actor on this
    machine, for its process to be gone (the table says so while the process still tears
    down). Regression (s41): it waited for the DEAD state only; a scheduler ``SIGSTOP``-ed
    during ``down`` was still a live process when the spill nodes were killed.

    The process is the one the actor table names only when this machine's ``/proc`` shows a
    Ray process under that pid (``_ray_process``), and the same one while its start time is:
    a pid of another PID namespace (a container sharing this machine's address) naming some
    process here, or one taken again after the worker exited, is not waited for. Regression
    (s41 review): such a process held the wait to ``timeout_s`` and False."""
    deadline = time.monotonic() + timeout_s
    try:
        handle = ray.get_actor(name, namespace=namespace)
    except ValueError:  # none of that name alive
        return True
    worker_id, process = _worker(handle)
    ray.kill(handle)
    while time.monotonic() < deadline:
        if not (_alive(name, namespace) or worker_id is not None and _worker_alive(worker_id) or _runs(process)):
            return True
        time.sleep(0.05)
    log.warning("actor %s of namespace %s killed, but its process did not end within %g s", name, namespace, timeout_s)
    return False


def _alive(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
        return True
    except ValueError:
        return False


def _gcs() -> Any:
    from ray._private import state  # no public API reads the GCS actor and worker tables

    return state.state._connect_and_get_accessor()


def _worker(handle: Any) -> tuple[Any, tuple[int, str] | None]:
    """The worker running ``handle``'s actor now: its id (a ``ray.WorkerID``) and, when it runs on
    this machine (a Ray node of this process's IP address), its process (``_ray_process``); None
    for what is not known (no worker: pending or restarting; the GCS actor table not readable;
    another machine, or a pid this machine's ``/proc`` shows no Ray process under)."""
    from ray.core.generated import gcs_pb2

    try:
        raw = _gcs().get_actor_info(handle._actor_id)
    except Exception as exc:  # noqa: BLE001 - an internal API: the DEAD state alone is waited for
        log.warning("the GCS actor table was not read (%s: %s): waiting for the DEAD state only", type(exc).__name__, exc)
        return None, None
    if raw is None:
        return None, None
    info = gcs_pb2.ActorTableData.FromString(raw)
    if not info.address.worker_id:
        return None, None
    local = info.address.ip_address == ray.util.get_node_ip_address()  # this machine (one of its Ray nodes)
    return ray.WorkerID(info.address.worker_id), _ray_process(info.pid) if local and info.pid else None


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the state on (field 3; the start time, field 22,
    is index 19); None when there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ray_process(pid: int) -> tuple[int, str] | None:
    """(``pid``, its start time in clock ticks) when this machine's ``/proc`` shows a Ray process
    under ``pid`` (its command line begins ``ray::``, the title Ray gives its workers), else None:
    the pid is of another PID namespace, or the worker is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            ray_titled = cmdline.read().startswith(b"ray::")
    except OSError:
        return None
    fields = _stat(pid)
    return (pid, fields[19]) if ray_titled and fields is not None else None


def _runs(process: tuple[int, str] | None) -> bool:
    """Whether ``process`` (``_ray_process``; None: not known, False) still exists and is no
    zombie: its pid names a process with its start time, not exited."""
    if process is None:
        return False
    fields = _stat(process[0])
    return fields is not None and fields[19] == process[1] and fields[0] != "Z"


def _worker_alive(worker_id: Any) -> bool:
    """Whether the GCS worker table lists ``worker_id`` alive (an unreadable table: alive)."""
    from ray.core.generated import gcs_pb2

    try:
        raw = _gcs().get_worker_info(worker_id)
    except Exception:  # noqa: BLE001 - asked again until the deadline
        return True
    return raw is not None and gcs_pb2.WorkerTableData.FromString(raw).is_alive
