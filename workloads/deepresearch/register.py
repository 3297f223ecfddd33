"""Register a workload's tenants over gRPC (TenantService) and collect their API keys."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc

from kvstrata.v1 import common_pb2, tenant_pb2, tenant_pb2_grpc
from tenants.keys import write_private_file
from workloads.deepresearch.config import TenantProfile

RPC_TIMEOUT_S = 30.0
"""The bound of each TenantService call a registration makes (none waits for ever)."""

_CLASSES = {
    "interactive": common_pb2.SLO_CLASS_INTERACTIVE,
    "standard": common_pb2.SLO_CLASS_STANDARD,
    "batch": common_pb2.SLO_CLASS_BATCH,
}


def profile_to_spec(profile: TenantProfile, name: str, policy: str = "") -> tenant_pb2.TenantSpec:
    return tenant_pb2.TenantSpec(
        name=name,
        slo_class=_CLASSES[profile.slo_class],
        ttft_slo_ms=profile.ttft_slo_ms,
        tpot_slo_ms=profile.tpot_slo_ms,
        min_tokens_per_s=profile.min_tokens_per_s,
        weight=profile.weight,
        kv_quota_bytes=profile.kv_quota_bytes,
        cache_namespace=profile.cache_namespace or name,
        policy=policy,
    )


class TenantNameTaken(RuntimeError):
    """A workload's tenant name is taken by a tenant the workload did not register;
    ``registered`` (tenant name -> key) holds the tenants registered before it was met."""

    def __init__(self, message: str, registered: Mapping[str, str]) -> None:
        super().__init__(message)
        self.registered = dict(registered)


async def register_tenants(
    channel: grpc.aio.Channel, admin_key: str, profiles: Iterable[TenantProfile], name_suffix: str = "",
    policy: str = "", earlier_keys: Mapping[str, str] | None = None, replace_any: bool = False,
    on_interrupt: Callable[[], None] | None = None,
) -> dict[str, str]:
    """Register each profile as tenant ``<name><name_suffix>``; returns profile name -> API key.

    A tenant of that name that exists already is replaced (deleted and registered again, its
    old key stops working, so a run starts from the profile's exact promises) only when this
    workload registered it: ``earlier_keys`` (tenant name -> the key an earlier run got) holds
    a key that is still that tenant's (``GetTenant`` with it passes), or ``replace_any`` is set
    (a deployment the caller started for itself). Otherwise the name belongs to someone else,
    whose key and cached KV a replacement would take away (review 23d: the demo pointed at a
    production gateway deleted its tenants of those names).

    Every taken name is checked before any tenant is registered or replaced, so a refused run
    changes nothing. Regression (fresh-user trial 24): the run replaced ``chat`` (its key and
    usage gone) before it found ``analyst`` taken and stopped.

    ``on_interrupt``: called (no arguments) when an interrupt starts the clean-up of tenants
    registered or a registration under way, before it waits for them (the CLI says so: with a
    gateway that does not answer, each of its calls waits up to ``RPC_TIMEOUT_S``). Regression
    (s41 diff review r1 of a5dc87e): the CLI said nothing for the 61 s such a clean-up took.

    Raises:
        TenantNameTaken: a name is taken by a tenant this workload did not register; nothing
            was registered, replaced or deleted (``registered`` is empty; it holds the keys of
            those registered before a name taken meanwhile, for the caller to save as
            ``earlier_keys`` of the next run).
        grpc.aio.AioRpcError: a registration failed otherwise; the tenants this call had
            registered before it are deleted again (best effort), so that no tenant stays
            under a key nobody holds. Regression (s40 diff review r7): they stayed, and the
            next run refused their names as another's (``TenantNameTaken``).
        asyncio.CancelledError, KeyboardInterrupt: the run was interrupted (Ctrl-C); the same
            clean-up first, the registration in flight included (``_take_back``).
    """
    stub = tenant_pb2_grpc.TenantServiceStub(channel)
    md = (("authorization", f"Bearer {admin_key}"),)
    profiles = list(profiles)
    if not replace_any:
        taken = {t.spec.name for t in (await stub.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=md,
                                                              timeout=30)).tenants}
        for profile in profiles:
            name = f"{profile.name}{name_suffix}"
            if name in taken and not await _holds_key_of(stub, name, (earlier_keys or {}).get(name, "")):
                raise TenantNameTaken(_taken_message(name), registered={})
    keys: dict[str, str] = {}
    sent: tuple[str, asyncio.Future[Any]] | None = None  # (profile name, its RegisterTenant in flight)
    try:
        for profile in profiles:
            name = f"{profile.name}{name_suffix}"
            request = tenant_pb2.RegisterTenantRequest(spec=profile_to_spec(profile, name, policy))
            try:
                sent = (profile.name, asyncio.ensure_future(stub.RegisterTenant(request, metadata=md, timeout=RPC_TIMEOUT_S)))
                resp = await asyncio.shield(sent[1])  # an interrupt leaves the call to end (``_take_back``)
            except grpc.aio.AioRpcError as err:
                sent = None
                if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                    raise
                if not replace_any and not await _holds_key_of(stub, name, (earlier_keys or {}).get(name, "")):
                    raise TenantNameTaken(_taken_message(name),  # taken since the check above
                                          registered={f"{p}{name_suffix}": k for p, k in keys.items()}) from None
                await stub.DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=md, timeout=RPC_TIMEOUT_S)
                sent = (profile.name, asyncio.ensure_future(stub.RegisterTenant(request, metadata=md, timeout=RPC_TIMEOUT_S)))
                resp = await asyncio.shield(sent[1])
            keys[profile.name], sent = resp.api_key, None
    except TenantNameTaken:
        raise
    except BaseException as exc:  # a registration failed, or the run was interrupted (Ctrl-C: CancelledError
        # or KeyboardInterrupt): those registered go again, the one in flight too once it answers
        if on_interrupt is not None and (keys or sent) and isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)):
            on_interrupt()
        await _take_back(stub, md, keys, sent, name_suffix)
        raise
    return keys


async def _take_back(stub: tenant_pb2_grpc.TenantServiceStub, md: tuple, keys: dict[str, str],
                     sent: tuple[str, asyncio.Future[Any]] | None, name_suffix: str) -> None:
    """Delete again the tenants of ``keys`` (profile name -> key) and the one whose
    registration ``sent`` was in flight when the run failed or was interrupted: its answer is
    awaited first (its own ``RPC_TIMEOUT_S`` bounds it), so a tenant the store registered after
    the interrupt is known and deleted too; one unanswered within its deadline is left alone
    (the name may be another's, who registered it meanwhile). Best effort: a delete that fails
    leaves that tenant. A second interrupt (Ctrl-C again: asyncio.run cancels the task once
    more) stops the clean-up where it is, the call in flight cancelled, what it had not deleted
    left (``asyncio.CancelledError`` raised).

    Regression (s41): Ctrl-C during ``kvstrata run``'s registrations (CancelledError, not an
    ``Exception``) skipped the clean-up: the tenants registered so far, and the one whose
    answer was on its way, stayed under keys nobody had, and the next run refused their names
    as another's (``TenantNameTaken``) until removed by hand.

    Regression (s41 diff review r1 of a5dc87e): a ``CancelledError`` out of the call in flight
    was suppressed, so a second Ctrl-C cancelled that call and the clean-up went on deleting,
    each delete up to its 30-s deadline (a gateway that did not answer: 31.7 s after the second
    Ctrl-C), where the README says a second Ctrl-C stops it."""
    if sent is not None:
        profile, call = sent
        with contextlib.suppress(grpc.aio.AioRpcError):  # refused: none; unanswered (past its deadline):
            keys[profile] = (await call).api_key  # not known, left alone (maybe another's)
    await _unregister(stub, md, [f"{p}{name_suffix}" for p in keys])


async def _unregister(stub: tenant_pb2_grpc.TenantServiceStub, md: tuple, names: Iterable[str]) -> list[str]:
    """Delete tenants ``names`` (gone already: fine); returns ``"name (CODE: details)"`` of each
    that could not be deleted."""
    left = []
    for name in names:
        try:
            await stub.DeleteTenant(tenant_pb2.DeleteTenantRequest(name=name), metadata=md, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.NOT_FOUND:
                left.append(f"{name} ({err.code().name}: {err.details()})")
    return left


def _taken_message(name: str) -> str:
    return (f"a tenant named {name!r} exists and this workload did not register it (no key of it from an "
            "earlier run here still works): replacing it would take its key and cached KV away. Nothing was "
            f"changed. Remove it yourself if it is yours (`kvstrata tenant rm {name}`), or use another deployment")


async def _holds_key_of(stub: tenant_pb2_grpc.TenantServiceStub, name: str, key: str) -> bool:
    """Whether ``key`` is tenant ``name``'s own working key (``GetTenant`` with it passes)."""
    if not key:
        return False
    try:
        await stub.GetTenant(tenant_pb2.GetTenantRequest(name=name), metadata=(("authorization", f"Bearer {key}"),),
                             timeout=30)
    except grpc.aio.AioRpcError as err:
        if err.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
            return False
        raise
    return True


KEYS_FILE = "workload_keys.json"
"""Where the CLI keeps the keys of the tenants its workloads registered (in its state dir, 0600),
per deployment (its gateway address): tenant names are per deployment."""


def load_keys(path: Path, deployment: str) -> dict[str, str]:
    """Tenant name -> key that ``save_keys`` saved at ``path`` for ``deployment``; {} when
    there is none, or the file is absent or unreadable."""
    entry = _load_all(path).get(deployment)
    if not isinstance(entry, dict):
        return {}
    return {k: v for k, v in entry.items() if isinstance(k, str) and isinstance(v, str)}


def save_keys(path: Path, deployment: str, keys: Mapping[str, str]) -> None:
    """Merge ``keys`` (tenant name -> key) into ``deployment``'s at ``path``: the file written
    whole to a 0600 temp file in its directory (made 0700 when absent), fsynced and renamed
    over it (``write_private_file``), the read-merge-write under an ``flock`` of
    ``.<name>.lock`` beside it.

    Regression (s38 durability audit): without the lock two workloads saving at once lost one's
    keys (its tenants then counted as someone else's: its next run stopped, exit 1)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        every = _load_all(path)
        every[deployment] = {**load_keys(path, deployment), **keys}
        write_private_file(path, json.dumps(every))
    finally:
        os.close(lock)


class KeysNotSaved(RuntimeError):
    """The keys of the tenants a run registered could not be saved (``save_or_unregister``)."""


async def save_or_unregister(channel: grpc.aio.Channel, admin_key: str, path: Path, deployment: str,
                             keys: Mapping[str, str]) -> None:
    """``save_keys(path, deployment, keys)`` (tenant name -> key); when the file cannot be
    written (its disk full, a read-only or missing state dir: ``OSError``) the tenants of
    ``keys`` are deleted again over ``channel``, so that the next run registers them anew.

    Regression (s40 diskfull): a save failing after the registrations raised ``OSError`` out of
    ``kvstrata run`` with a traceback, the new keys only in memory: the next run found the
    tenants it had replaced under keys nobody had, so it refused every name as another's
    (``TenantNameTaken``) until the operator removed them by hand.

    Raises:
        KeysNotSaved: naming the file, the error, and any tenant that could not be deleted
            (to remove by hand); the tenants deleted hold nothing a next run would not replace.
    """
    if not keys:  # nothing registered: nothing to save (the file is not touched)
        return
    try:
        save_keys(path, deployment, keys)
        return
    except OSError as exc:
        error = exc
    left = await _unregister(tenant_pb2_grpc.TenantServiceStub(channel), (("authorization", f"Bearer {admin_key}"),),
                             keys)
    said = f"the keys of the tenants this run registered could not be saved to {path} ({error}): "
    if left:
        raise KeysNotSaved(said + "these could not be removed again, remove them yourself (`kvstrata tenant rm "
                           f"NAME`) before the next run: {'; '.join(left)}") from error
    raise KeysNotSaved(said + f"they were removed again ({', '.join(keys)}); make room there and run again") from error


def _load_all(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
