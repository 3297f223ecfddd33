"""What a gateway knows of the key ids that exist (``KeyDirectory``, from the scheduler's
``key_ids_since``) and of the ones whose checks failed here lately (``SuspectKeyIds``): the
parts of ``services.auth``'s bounds on the scheduler's key checks that track key ids (see its
module docstring for the whole scheme)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from tenants.keys import is_key_id
from tenants.ratelimit import ExpiringSet, WindowLimiter
from tenants.store_key_ids import MAX_KEY_IDS_ASKED

log = logging.getLogger(__name__)

_DIRECTORY_TIMEOUT_S = 5.0
"""A key-directory refresh that takes longer fails (its callers fall back to the budgeted checks)."""
_MAX_DIRECTORY_IDS = 1 << 18
"""Key ids one directory reply may name and the directory may hold (past that a reply is refused
as malformed: the gateway falls back to the budgeted checks)."""
_TOO_MANY_RETRY_S = 300.0
"""After a reply of more than ``_MAX_DIRECTORY_IDS`` ids, the directory is not asked again for
this long (seconds): each such reply is a full read of the store, so meanwhile every refresh is
``UNUSABLE`` at once and ``which_exist`` asks ``key_ids_exist`` about the ids it needs."""
APPLIED, UNREACHABLE, UNUSABLE = "applied", "unreachable", "unusable"
"""A refresh's outcomes (``KeyDirectory.refresh_outcome``): its reply applied; no answer (an
error, a timeout); an answer that cannot be applied (no ``key_ids_since``, malformed, too many ids)."""
_EPOCH_PATTERN = re.compile(r"[0-9a-f]{16}")
SUSPECT_TTL_S = 3600.0
"""How long a key id not known here stays suspect after its last failed check here (``SuspectKeyIds``)."""
_WAITING_TTL_S = 30.0
"""How long a key refused for want of budget keeps its turn for a retry (``SuspectKeyIds``)."""
_MAX_WAITING = 65536
"""Keys refused for want of budget remembered at most (one per key id and address; past it the
oldest are forgotten)."""


class KeyDirectory:
    """The key ids that exist in the tenant store (``key_ids_since``), as this gateway last heard.

    ``exists`` answers from memory for an id it holds; for any other id it awaits one refresh
    started after the call: every concurrent caller shares the refresh in flight (or the one
    about to start), and refreshes start at most ``refreshes_per_s`` times a second, so this
    directory costs the scheduler at most that many calls a second whatever the number of keys
    asked about. Each reply is a delta since the last one (or every id, after a scheduler
    restart); it is checked as untrusted input (``_parse_key_ids``: types, sizes, id pattern,
    continuity). A malformed reply, an error, a timeout (``_DIRECTORY_TIMEOUT_S``) or a
    scheduler without ``key_ids_since`` leave the directory as it was, and the callers that
    waited get ``None`` (not known). The directory holds at most what the store holds: ids
    removed there (deleted tenants, rotated keys) are dropped and passed to ``on_removed``.

    Args:
        scheduler: the GlobalScheduler actor handle (``key_ids_since``).
        refreshes_per_s: refreshes started a second at most (> 0).
        on_removed: called with the set of ids a refresh found removed.

    Raises:
        ValueError: ``refreshes_per_s`` <= 0.
    """

    def __init__(self, scheduler: Any, refreshes_per_s: float = 10.0,
                 on_removed: Callable[[set[str]], None] = lambda ids: None) -> None:
        if not refreshes_per_s > 0:
            raise ValueError(f"refreshes_per_s must be > 0, got {refreshes_per_s}")
        self.scheduler, self.interval_s, self.on_removed = scheduler, 1.0 / refreshes_per_s, on_removed
        self.ids: set[str] = set()
        self.loaded = False  # a reply was applied
        self.refreshes = 0  # refreshes started
        self._epoch, self._version = "", -1
        self._supported = True
        self._too_many_until = 0.0  # time.monotonic() before which the store is known too large
        self._next_start_s = 0.0  # time.monotonic() before which no refresh starts
        self._task: asyncio.Task[tuple[int, str]] | None = None

    async def exists(self, key_id: str) -> bool | None:
        """Whether a key of ``key_id`` exists: True from memory when held, else as of a refresh
        started after this call (True or False), or ``None`` when that refresh failed or none
        can be made."""
        if key_id in self.ids:
            return True
        return (key_id in self.ids) if await self.refresh() else None

    async def refresh(self) -> bool:
        """Await one refresh started after this call (shared with every concurrent caller, at
        most ``refreshes_per_s`` a second); True when its reply was applied (``ids`` is then
        the store's as of a read made after this call), False when it failed or none can be
        made (no ``key_ids_since``). ``refresh_outcome`` says which failure."""
        return await self.refresh_outcome() == APPLIED

    async def refresh_outcome(self) -> str:
        """``refresh``, telling why it failed: ``APPLIED``; ``UNREACHABLE`` (an error, a timeout:
        the scheduler did not answer); or ``UNUSABLE`` (it answered, but no reply can be
        applied: a scheduler without ``key_ids_since``, a malformed reply, or more ids than
        ``_MAX_DIRECTORY_IDS``: then for ``_TOO_MANY_RETRY_S`` every refresh is ``UNUSABLE`` at
        once, with no call to the scheduler)."""
        needed = self.refreshes + 1
        while self._supported and time.monotonic() >= self._too_many_until:
            loop = asyncio.get_running_loop()
            if self._task is None or self._task.get_loop() is not loop:  # none, or a closed loop's
                self._task = loop.create_task(self._refresh())
            number, outcome = await asyncio.shield(self._task)
            if number >= needed:
                return outcome
        return UNUSABLE

    async def which_exist(self, key_ids: set[str]) -> tuple[str, set[str]]:
        """Which of ``key_ids`` exist as of a read started after this call: ``(APPLIED, the
        ids that exist)`` from a refresh (``refresh_outcome``), or, when the directory is
        unusable, from the scheduler's ``key_ids_exist`` asked about just these ids (batches
        of ``MAX_KEY_IDS_ASKED``); ``(UNREACHABLE, set())`` when the scheduler did not answer;
        ``(UNUSABLE, set())`` when it answered but neither way can tell (no ``key_ids_exist``,
        or a malformed reply). The key watch and a Drain's admin key check confirm keys so.
        Regression (review r1 F1, session 37): a store of more than ``_MAX_DIRECTORY_IDS`` ids
        (or a scheduler without ``key_ids_since``) failed every refresh, which the key watch
        took for an unreachable scheduler: every stream ended UNAVAILABLE past
        ``key_staleness_max_s``."""
        outcome = await self.refresh_outcome()
        if outcome == APPLIED:
            return APPLIED, key_ids & self.ids
        if outcome == UNREACHABLE or not key_ids:
            return outcome, set()
        return await self._ask_exist(sorted(key_ids))

    async def _ask_exist(self, asked: list[str]) -> tuple[str, set[str]]:
        """``which_exist``'s question to the scheduler's ``key_ids_exist``, in batches."""
        try:
            method = self.scheduler.key_ids_exist
        except AttributeError:
            return UNUSABLE, set()
        found: set[str] = set()
        for start in range(0, len(asked), MAX_KEY_IDS_ASKED):
            batch = asked[start:start + MAX_KEY_IDS_ASKED]
            try:
                reply = await asyncio.wait_for(method.remote(key_ids=batch), _DIRECTORY_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - any failure means: not known
                log.warning("asking which key ids exist failed: %s: %.200s", type(exc).__name__, exc)
                return UNREACHABLE, set()
            if not isinstance(reply, (tuple, list)) or not all(type(k) is str for k in reply) or \
                    not set(reply) <= set(batch):
                log.warning("ignoring a malformed key_ids_exist reply (a %s)", type(reply).__name__)
                return UNUSABLE, set()
            found |= set(reply)
        return APPLIED, found

    async def _refresh(self) -> tuple[int, str]:
        """Wait for the rate's next slot, then ask the scheduler; ``(the refresh's number,
        its outcome)``."""
        try:
            wait_s = self._next_start_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self.refreshes += 1
            self._next_start_s = time.monotonic() + self.interval_s
            return self.refreshes, await self._fetch()
        finally:
            if self._task is asyncio.current_task():
                self._task = None

    async def _fetch(self) -> str:
        try:
            method = self.scheduler.key_ids_since
        except AttributeError:  # a scheduler (or a test's stand-in) without a directory
            self._supported = False
            return UNUSABLE
        try:
            reply = await asyncio.wait_for(method.remote(epoch=self._epoch, version=self._version), _DIRECTORY_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - any failure means: not known, fall back
            log.warning("key directory refresh failed: %s: %.200s", type(exc).__name__, exc)
            return UNREACHABLE
        if isinstance(reply, (tuple, list)) and len(reply) == 5 and \
                isinstance(reply[3], (tuple, list, set, frozenset)) and len(reply[3]) > _MAX_DIRECTORY_IDS:
            return self._too_many(len(reply[3]))
        parsed = _parse_key_ids(reply, self._epoch, self._version)
        if parsed is None:
            log.warning("ignoring a malformed key directory reply (a %s)", type(reply).__name__)
            return UNUSABLE
        epoch, version, full, added, removed = parsed
        ids = added if full else (self.ids - removed) | added
        if len(ids) > _MAX_DIRECTORY_IDS:
            return self._too_many(len(ids))
        gone = self.ids - ids
        self.ids, self._epoch, self._version, self.loaded = ids, epoch, version, True
        if gone:
            self.on_removed(gone)
        return APPLIED


    def _too_many(self, count: int) -> str:
        """The store holds ``count`` key ids, more than ``_MAX_DIRECTORY_IDS``: no directory try
        for ``_TOO_MANY_RETRY_S`` (logged once per such pause); ``UNUSABLE``. Regression (s37
        review r4, F4): such a reply was taken for a malformed one and nothing was remembered,
        so every refresh (every key watch check, every unknown key's check) read the whole
        store again (~272k ids, 117-248 ms under its lock) and logged a warning."""
        self._too_many_until = time.monotonic() + _TOO_MANY_RETRY_S
        log.warning("the tenant store holds %d key ids, more than a key directory may (%d): keys are "
                    "asked about by id (key_ids_exist); the directory is tried again in %.0f s",
                    count, _MAX_DIRECTORY_IDS, _TOO_MANY_RETRY_S)
        return UNUSABLE


def _parse_key_ids(reply: Any, epoch: str, version: int) -> tuple[str, int, bool, set[str], set[str]] | None:
    """``(epoch, version, full, added, removed)`` of a ``tenants.store_key_ids.KeyIdsDelta``
    reply to ``key_ids_since(epoch, version)``, or ``None`` when it is malformed: not a 5-tuple
    of a 16-hex-character epoch, an int version in [0, 2**63), a bool, and two lists of at most
    ``_MAX_DIRECTORY_IDS`` key ids (``tenants.keys.is_key_id``), disjoint; a delta (not full)
    must continue ``(epoch, version)``, and a full one removes nothing."""
    if not isinstance(reply, (tuple, list)) or len(reply) != 5:
        return None
    new_epoch, new_version, full, added, removed = reply
    if type(new_epoch) is not str or not _EPOCH_PATTERN.fullmatch(new_epoch):
        return None
    if type(new_version) is not int or not 0 <= new_version < 2**63 or type(full) is not bool:
        return None
    groups = []
    for group in (added, removed):
        if not isinstance(group, (tuple, list, set, frozenset)) or len(group) > _MAX_DIRECTORY_IDS:
            return None
        if not all(is_key_id(key_id) for key_id in group):
            return None
        groups.append(set(group))
    if groups[0] & groups[1] or (full and groups[1]):
        return None
    if not full and (new_epoch != epoch or new_version < version):
        return None
    return new_epoch, new_version, full, groups[0], groups[1]


class SuspectKeyIds:
    """Key ids with a failed check here lately (*suspect*), and the share of the gateway's budget
    of checks of unknown key ids that their keys may use.

    A key id is suspect for ``ttl_s`` after a check of a key of it failed here (from any address,
    in either role), until a key of it passes (``cleared``). The checks of suspect ids' keys
    together take at most ``checks_per_s`` a second and ``checks_in_flight`` at once (the
    ``Authenticator`` gives them half its budget, so the other half always serves ids that never
    failed here), and at most one at once per id, so floods of wrong secrets for many ids share
    that half by id (max-min fair at once) and none starves another id's checks.

    Within one id, turns go to keys that were refused first: a key refused for want of budget is
    remembered with its address (``refused``: one key per id and address, the newest, for
    ``_WAITING_TTL_S``), and while a suspect id has such keys waiting, a check of that id goes to
    one of them (any, first come) and any other key of it is refused and waits in turn. A flood
    of fresh wrong secrets for an id thus gets its checks only while no one waits, and the owner,
    refused once, is checked on its retry with the same key from the same address. Limits: one
    key waits per id and address (a client sharing the owner's address can replace its turn),
    ``_MAX_WAITING`` in all (``_MAX_WAITING`` refusals of other id and address pairs between two
    tries of the owner forget its turn), and attackers that retry their own waiting keys compete
    with the owner first come, each such key checked once (it then fails and is cached as failed).

    Args:
        checks_per_s: suspect ids' checks a second at most, all ids together (>= 1).
        checks_in_flight: their checks at once at most (>= 1).
        ttl_s: how long an id stays suspect after its last failure, seconds (> 0).
        clock: monotonic seconds.

    Raises:
        ValueError: a count < 1 or ``ttl_s`` <= 0.
    """

    def __init__(self, checks_per_s: int, checks_in_flight: int, ttl_s: float = SUSPECT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if checks_in_flight < 1 or not ttl_s > 0:
            raise ValueError(f"need checks_in_flight >= 1 and ttl_s > 0, got {checks_in_flight}, {ttl_s}")
        self.checks_in_flight, self.clock = checks_in_flight, clock
        self._ids = ExpiringSet(ttl_s, clock, max_keys=_MAX_DIRECTORY_IDS)
        self._checks = WindowLimiter(checks_per_s, 1.0, clock, max_keys=1)
        self._running: set[str] = set()  # suspect ids with a check running
        self._waiting: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()  # (id, host) -> (fp, until)
        self._waiting_per_id: dict[str, int] = {}

    def __contains__(self, key_id: str) -> bool:
        return key_id in self._ids

    def failed(self, key_id: str) -> None:
        """A check of a key of ``key_id`` (not known here) failed: the id is suspect from now."""
        self._ids.add(key_id)

    def cleared(self, key_id: str) -> None:
        """A key of ``key_id`` passed (or the id is gone): it is no longer suspect."""
        self._ids.discard(key_id)

    def wait_s(self, key_id: str, host: str, fp: bytes) -> float:
        """Seconds before the key ``fp`` of the suspect ``key_id`` from ``host`` may be checked
        (0: now): the share is spent, the id has a check running, or others wait before it."""
        rate_wait_s = self._checks.retry_after_s(None)
        busy = len(self._running) >= self.checks_in_flight or key_id in self._running
        if busy or rate_wait_s > 0 or not self._has_turn(key_id, host, fp):
            return max(rate_wait_s, 1.0)
        return 0.0

    def start(self, key_id: str, host: str, suspect: bool) -> None:
        """A check of a key of ``key_id`` from ``host`` starts: that address's turn for the id,
        if it had one, is used; a ``suspect`` id's check counts against the share until
        ``finish``."""
        self._forget_waiting((key_id, host))
        if suspect:
            self._checks.try_acquire(None)
            self._running.add(key_id)

    def finish(self, key_id: str) -> None:
        """The check of a key of the suspect ``key_id`` that ``start`` counted is over."""
        self._running.discard(key_id)

    def refused(self, key_id: str, host: str, fp: bytes) -> None:
        """The key ``fp`` of ``key_id`` from ``host`` was refused for want of budget: it waits
        for a turn (replacing that address's earlier key of that id)."""
        self._forget_waiting((key_id, host))
        self._waiting[(key_id, host)] = (fp, self.clock() + _WAITING_TTL_S)
        self._waiting_per_id[key_id] = self._waiting_per_id.get(key_id, 0) + 1
        while len(self._waiting) > _MAX_WAITING:
            self._forget_waiting(next(iter(self._waiting)))

    def _has_turn(self, key_id: str, host: str, fp: bytes) -> bool:
        """No key of ``key_id`` waits, or this one does."""
        now = self.clock()
        while self._waiting and next(iter(self._waiting.values()))[1] <= now:  # oldest first
            self._forget_waiting(next(iter(self._waiting)))
        waiting = self._waiting.get((key_id, host))
        return not self._waiting_per_id.get(key_id) or (waiting is not None and waiting[0] == fp)

    def _forget_waiting(self, entry: tuple[str, str]) -> None:
        if self._waiting.pop(entry, None) is None:
            return
        left = self._waiting_per_id[entry[0]] - 1
        if left:
            self._waiting_per_id[entry[0]] = left
        else:
            del self._waiting_per_id[entry[0]]
