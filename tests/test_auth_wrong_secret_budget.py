"""Wrong secrets for key ids that exist never starve valid keys of the gateway's check budget
(secrev18 residue): key ids are not secret, so an attacker can send wrong secrets for real ids
from many addresses; each such key passes the key directory and costs a check of the budget of
key ids not known here (100 a second, 16 at once). Before, such a flood took the whole budget,
and a valid key never used at this gateway (a new tenant, a rotated key, after a restart), or
the attacked id's own owner, got RESOURCE_EXHAUSTED for as long as it lasted.

The gateway's ``Authenticator`` runs over a real in-process ``GlobalSchedulerService`` (the
``gateway`` fixture of ``tests.test_auth_key_directory``, which records every call), or over
``tests.test_auth_flood``'s counting stand-in with an injected clock.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc

import services.auth
import services.key_ids
from services.auth import Authenticator
from tenants.keys import fingerprint, new_api_key, parse_key_id
from tenants.model import TenantSpec
from tests.test_auth_flood import _code, _CountingScheduler, _Ctx, _tenant, _wrong_secret
from tests.test_auth_key_directory import _host, gateway  # noqa: F401 - the fixture

_WAVES, _WAVE = 8, 200


class _Clock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


def test_a_valid_first_time_key_passes_under_wrong_secrets_for_existing_ids(gateway) -> None:  # noqa: F811
    """Regression (secrev18 residue): waves of 200 wrong secrets for three existing key ids
    (two tenants' and the admin key's), each from its own address, took the gateway's 16 checks
    at once in every wave (up to its 100 a second: 99 checks in 8 waves), so carol's valid key,
    never used at this gateway, and erin's (on a call that takes the admin key or a tenant's) got
    RESOURCE_EXHAUSTED in the fourth wave. Now the attacked ids are suspect after their first
    failures: carol's and erin's keys pass on their first try, as does
    dave's (a tenant registered during the flood, as through another gateway: it waits for a
    directory refresh first), and the flood costs the scheduler its first wave's 16 checks and
    none after (the refused keys of the first wave wait for their turns, which they never take)."""
    scheduler, handle, auth, admin_key = gateway
    _, ann_key = scheduler.store.register(TenantSpec("ann"))
    _, bob_key = scheduler.store.register(TenantSpec("bob"))
    _, carol_key = scheduler.store.register(TenantSpec("carol"))
    _, erin_key = scheduler.store.register(TenantSpec("erin"))
    targets = [ann_key, bob_key, admin_key]
    flood_keys: list[str] = []

    def wave(number: int) -> list:
        keys = [_wrong_secret(targets[i % 3]) for i in range(_WAVE)]
        flood_keys.extend(keys)
        return [_code(auth.tenant, _Ctx(key, _host(number * _WAVE + i))) for i, key in enumerate(keys)]

    async def run() -> tuple[Counter, list[grpc.StatusCode]]:
        codes: Counter = Counter()
        valid = []
        for number in range(_WAVES):
            if number == 3:
                *flood, carol, erin = await asyncio.gather(
                    *wave(number), _code(auth.tenant, _Ctx(carol_key, "192.0.2.1")),
                    _code(auth.admin_or_tenant, _Ctx(erin_key, "192.0.2.3")))  # e.g. RotateKey for herself
                valid += [carol, erin]
                _, dave_key = scheduler.store.register(TenantSpec("dave"))  # as through another gateway
            elif number == 5:
                *flood, dave = await asyncio.gather(*wave(number), _code(auth.tenant, _Ctx(dave_key, "192.0.2.2")))
                valid.append(dave)
            else:
                flood = await asyncio.gather(*wave(number))
            codes.update(flood)
        return codes, valid

    codes, valid = asyncio.run(run())

    assert valid == [grpc.StatusCode.OK] * 3  # before: RESOURCE_EXHAUSTED, RESOURCE_EXHAUSTED, OK
    flood_checks = [key for key in handle.asked("authenticate") if key in set(flood_keys)]
    assert len(flood_checks) == auth.unknown_checks_in_flight  # the first wave's; before: 16 a wave
    assert codes == {grpc.StatusCode.UNAUTHENTICATED: len(flood_checks),
                     grpc.StatusCode.RESOURCE_EXHAUSTED: _WAVES * _WAVE - len(flood_checks)}
    assert all(parse_key_id(key) in auth._suspects for key in targets)


def test_the_owner_of_an_attacked_key_id_passes_on_its_retry(gateway) -> None:  # noqa: F811
    """Regression (secrev18 residue): waves of 50 wrong secrets for ann's key id from fresh
    addresses, ann's own key (never used at this gateway) last in each wave: the flood took the
    gateway's checks in every wave and ann got RESOURCE_EXHAUSTED in all 8. Now ann's key,
    refused in the first wave (the id had not failed yet), keeps its turn and passes on its
    first retry, while the later waves' fresh wrong secrets wait behind it; ann's id is known
    (and no longer suspect) from then on."""
    scheduler, handle, auth, _ = gateway
    _, ann_key = scheduler.store.register(TenantSpec("ann"))

    async def run() -> list[grpc.StatusCode]:
        codes = []
        for number in range(_WAVES):
            flood = [_code(auth.tenant, _Ctx(_wrong_secret(ann_key), _host(number * 50 + i))) for i in range(50)]
            *_, ann = await asyncio.gather(*flood, _code(auth.tenant, _Ctx(ann_key, "192.0.2.1")))
            codes.append(ann)
        return codes

    codes = asyncio.run(run())

    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] + [grpc.StatusCode.OK] * (_WAVES - 1)  # before: all 8 refused
    assert handle.asked("authenticate").count(ann_key) == 1
    assert auth._known_fingerprint(parse_key_id(ann_key) or "") == fingerprint(ann_key)
    assert parse_key_id(ann_key) not in auth._suspects


def test_suspect_key_ids_take_at_most_half_the_budget_one_check_each() -> None:
    """While the scheduler is slow, 20 suspect key ids x 5 wrong secrets (each from its own
    address) get 8 checks at once (half of ``unknown_checks_in_flight``), one per id; a valid key
    of an id that never failed here passes meanwhile. Over a second (a fixed clock), suspect ids
    get 50 checks (half of ``unknown_checks_per_s``) and the rest of the budget stays for others."""
    clock = _Clock()
    carol_key, dave_key = new_api_key(), new_api_key()
    scheduler = _CountingScheduler({carol_key: _tenant("carol"), dave_key: _tenant("dave")})
    auth = Authenticator(scheduler, clock=clock)
    ids = [new_api_key() for _ in range(80)]  # one key of each id: the ids' real keys

    async def run() -> tuple[int, set[str], grpc.StatusCode, list[grpc.StatusCode], grpc.StatusCode]:
        for i, key in enumerate(ids):  # a first failure each (no directory: every id is checked)
            assert await _code(auth.tenant, _Ctx(_wrong_secret(key), _host(i))) == grpc.StatusCode.UNAUTHENTICATED
        clock.now_s += 1.0
        scheduler.calls.clear()
        scheduler.hold = asyncio.Event()
        contexts = [_Ctx(_wrong_secret(ids[i % 20]), _host(1000 + i)) for i in range(100)]
        tasks = [asyncio.ensure_future(_code(auth.tenant, ctx)) for ctx in contexts]
        for _ in range(5):
            await asyncio.sleep(0)
        waiting = list(scheduler.calls)
        carol = await _code(auth.tenant, _Ctx(carol_key, "192.0.2.1"))
        scheduler.hold.set()
        await asyncio.gather(*tasks)
        clock.now_s += 1.0
        scheduler.calls.clear()
        rate = [await _code(auth.tenant, _Ctx(_wrong_secret(key), _host(2000 + i))) for i, key in enumerate(ids[20:])]
        dave = await _code(auth.tenant, _Ctx(dave_key, "192.0.2.2"))
        return len(waiting), {parse_key_id(key) or "" for key in waiting}, carol, rate, dave

    in_flight, in_flight_ids, carol, rate, dave = asyncio.run(run())

    assert in_flight == len(in_flight_ids) == 8  # before: 16, several of one id
    assert carol == grpc.StatusCode.OK
    assert rate == [grpc.StatusCode.UNAUTHENTICATED] * 50 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 10
    assert dave == grpc.StatusCode.OK
    assert len(scheduler.calls) == 51


def test_suspicion_and_turns_expire() -> None:
    """``SuspectKeyIds``' contract on a fixed clock: an id is suspect for ``ttl_s`` after its last
    failure, or until cleared; while keys of an id wait, only they get turns (one per address,
    the newest key), others wait 1 s; a turn lasts ``_WAITING_TTL_S``; one check at once per id."""
    clock = _Clock()
    suspects = services.key_ids.SuspectKeyIds(checks_per_s=50, checks_in_flight=8, ttl_s=60.0, clock=clock)
    a, b = fingerprint(new_api_key()), fingerprint(new_api_key())
    suspects.failed("0123456789ab")
    assert "0123456789ab" in suspects and "ba9876543210" not in suspects
    clock.now_s += 59.0
    assert "0123456789ab" in suspects
    clock.now_s += 1.0
    assert "0123456789ab" not in suspects
    suspects.failed("0123456789ab")
    suspects.cleared("0123456789ab")
    assert "0123456789ab" not in suspects

    assert suspects.wait_s("0123456789ab", "h1", a) == 0.0  # no one waits
    suspects.refused("0123456789ab", "h1", a)
    assert suspects.wait_s("0123456789ab", "h2", b) == 1.0  # h1's key has the turn
    assert suspects.wait_s("0123456789ab", "h1", b) == 1.0  # another key from h1: not its turn
    assert suspects.wait_s("0123456789ab", "h1", a) == 0.0
    assert suspects.wait_s("ba9876543210", "h2", b) == 0.0  # another id: its own turns
    suspects.start("0123456789ab", "h1", suspect=True)
    assert suspects.wait_s("0123456789ab", "h2", b) == 1.0  # one check at once per id
    suspects.finish("0123456789ab")
    assert suspects.wait_s("0123456789ab", "h2", b) == 0.0  # h1's turn was used
    suspects.refused("0123456789ab", "h1", a)
    clock.now_s += services.key_ids._WAITING_TTL_S
    assert suspects.wait_s("0123456789ab", "h2", b) == 0.0  # h1 did not come back in time
