"""A session belongs to the ``cache_salt`` (the cache namespace) its turns were sent under, as
the prefix cache does (review s36 E1).

The fault: the gateway scoped a session's id by its tenant alone
(``scoped_id(tenant, session_id)``), and the cache node's ``SessionTable.attach`` compared only
the tenant. A caller of the tenant under another salt, or none, naming the same session id
continued the first salt's session: its turn was answered over that salt's private conversation
(the node puts the history in front of a token-id turn, so the caller needed to know nothing of
it), it extended or rewrote that history, and its ``DELETE /v1/sessions/{id}`` closed it (and
was told the history's size).

Now the gateway scopes a session by tenant and salt (``gateway_inputs.session_scope``): under
another salt the same id is another session, and a close names the salt (gRPC
``CloseSessionRequest.cache_salt``, HTTP ``DELETE /v1/sessions/{id}?cache_salt=``). Behind it
the node binds a session to the namespace it was opened under and refuses a turn of another
namespace PERMISSION_DENIED, the session left as it was (``sessions.check_turn``): the second
guard, which also refuses the open sessions of a tenant an admin moved to another namespace
(no request runs in a namespace its tenant has left).

This file: the id scoping (and the scheduler's stored routes and a restarted scheduler's node
reports with the new ids), and the node's guard on the real ``LLMEngine`` (tiny random Llama).
End to end through the gateway: tests/test_session_salt_served.py.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.kv_pool import KVPool
from cache_node.model_loader import LoadedModel
from cache_node.outputs import SessionBusy
from cache_node.sampling_params import SamplingParams
from cache_node.sessions import SessionNamespaceChanged, client_session_id
from services import global_scheduler_admission as admission
from services.gateway_inputs import salted_namespace, scoped_id
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import GlobalSchedulerService
from services.global_scheduler_recovery import RecoveryPeers
from services.recovery_report import BadReport, session_row
from tenants.model import TenantSpec
from tests.test_session_rewind_state import drain
from tests.test_tier_engine import prompt_of

BS = 4
TENANT = "ab12cd34ef56ab78"
OWN = f"tenant:{TENANT}"
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


def engine(tiny: LoadedModel) -> LLMEngine:
    mc = tiny.model.config
    per_token = KVPool.bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads,
                                       mc.hidden_size // mc.num_attention_heads, tiny.model.dtype)
    return LLMEngine(tiny.model, EngineConfig(block_size=BS, kv_pool_bytes=256 * per_token,
                                              max_num_batched_tokens=64, max_num_seqs=4),
                     tiny.model_id, tiny.eos_token_ids)


def test_a_session_id_is_scoped_by_tenant_and_salt() -> None:
    """Each (tenant, salt, session id) has its own scoped id, whatever characters the salt and
    the id hold (``/``, NUL, a lone surrogate of a JSON body), and the node reads the client's id
    back from it (``client_session_id``: the id its refusals name)."""
    from services.gateway_inputs import session_scope  # (not in fa49863)

    salts = ["", "u1", "u2", "a", "a/b", "b", "\x00", "a\x00", "\ud800", "/", "0" * 32]
    ids = ["chat-1", "b/c", "c", "/", "//x", "\x00b", "0" * 32 + "/x", "a" * 256]
    seen: dict[str, tuple[str, str, str]] = {}
    for tenant, salt, sid in itertools.product([TENANT, "ab12cd34ef56ab79"], salts, ids):
        scoped = session_scope(tenant, salt, sid)
        assert seen.setdefault(scoped, (tenant, salt, sid)) == (tenant, salt, sid)
        assert session_row(scoped, tenant, True) == (scoped, tenant, True)  # a node's report takes it
        assert client_session_id(scoped, tenant) == sid
    # the unsalted id of a session named after a salted one's scope is still another session
    tagged = session_scope(TENANT, "u1", "chat-1")
    for client in (tagged.split("/", 1)[1], tagged.partition(":")[2], tagged, tagged.split(TENANT, 1)[1]):
        assert session_scope(TENANT, "", client) != tagged
        assert client_session_id(session_scope(TENANT, "", client), TENANT) == client
    # a report's session id must be one of the two forms, with a whole tag and a client id
    tag = tagged[len(TENANT) + 1:len(TENANT) + 33]
    for bad in (f"{TENANT}:", f"{TENANT}:{tag}/", f"{TENANT}:{tag}x", f"{TENANT}:{tag[:-1]}/x",
                f"{TENANT}:{tag.upper()}/x", f"{TENANT}/", f"{TENANT}x:{tag}/x", f"ab:{tag}/x"):
        with pytest.raises(BadReport):
            session_row(bad, TENANT, True)
    # an unsalted session keeps the id every session had before salts (review s36 R2 F1)
    for sid in ids:
        assert session_scope(TENANT, "", sid) == scoped_id(TENANT, sid)


def test_a_turn_under_another_namespace_is_refused_and_changes_nothing(tiny: LoadedModel) -> None:
    """A session opened under salt u1; a turn naming its (node-side) id under salt u2, under no
    salt, or of another tenant is refused PermissionError, before and while it runs a turn
    (never ``SessionBusy``: whether it is busy is not that caller's to know), and
    ``check_session_free`` (the node's check before it renders a turn) refuses it the same. The
    session's history and KV are untouched: its own next turn continues from all of it.

    The session's id is the one fa49863's gateway sent under every salt (scoped by the tenant
    alone): the node's guard holds whatever id reaches it. On fa49863 the u2 turn was admitted
    and continued from u1's pinned history (cached 43 of its 47 prompt tokens)."""
    eng = engine(tiny)
    sid = scoped_id(TENANT, "chat-1")
    u1, u2 = salted_namespace(OWN, "u1"), salted_namespace(OWN, "u2")
    eng.add_request(prompt_of(40, 1), PARAMS, request_id="t1", cache_namespace=u1, session_id=sid, tenant=TENANT)
    drain(eng)
    history = eng.session_history(sid)
    assert history is not None and len(history) == 44
    blocks = list(eng.sessions.sessions[sid].blocks)
    for namespace, tenant in [(u2, TENANT), (OWN, TENANT), (u1, "ffff0000ffff0000")]:
        with pytest.raises(PermissionError) as refused:
            eng.add_request(history + [7, 8, 9], PARAMS, request_id=f"x-{namespace}-{tenant}",
                            cache_namespace=namespace, session_id=sid, tenant=tenant)
        assert "u1" not in str(refused.value)  # (the other salt is never named)
        # the tenant's own: FAILED_PRECONDITION (close and reopen); another tenant's: PERMISSION_DENIED
        assert (type(refused.value) is SessionNamespaceChanged) == (tenant == TENANT)
        with pytest.raises(PermissionError):
            eng.check_session_free(sid, tenant, namespace)
    assert not eng.has_unfinished_requests()
    sess = eng.sessions.sessions[sid]
    assert (sess.token_ids, sess.blocks, sess.active_request) == (history, blocks, None)
    # while the session runs a turn of its own, the other salt is refused for the salt, never busy
    eng.add_request(history + [7, 8, 9], PARAMS, request_id="t2", cache_namespace=u1, session_id=sid, tenant=TENANT)
    with pytest.raises(SessionBusy) as busy:
        eng.check_session_free(sid, TENANT, u1)
    assert "'chat-1'" in str(busy.value)  # the client's id, without the tenant
    with pytest.raises(PermissionError):
        eng.check_session_free(sid, TENANT, u2)
    with pytest.raises(PermissionError):
        eng.add_request(history + [7, 8, 9], PARAMS, request_id="x2", cache_namespace=u2, session_id=sid,
                        tenant=TENANT)
    out = drain(eng)
    assert set(out) == {"t2"} and out["t2"].num_cached_tokens == len(history) - 1  # its whole history
    assert eng.session_history(sid) == history + [7, 8, 9, *out["t2"].output_token_ids]
    eng.check_integrity()


def test_the_engines_default_namespace_is_the_same_namespace(tiny: LoadedModel) -> None:
    """A request naming no namespace runs in the engine's default one
    (``EngineConfig.cache_namespace_default``): its session's turns may name it or leave it
    unnamed, and ``check_session_free`` takes "" as the engine does."""
    eng = engine(tiny)
    eng.add_request(prompt_of(20, 1), PARAMS, request_id="t1", session_id="s", tenant="t")
    drain(eng)
    history = eng.session_history("s")
    assert history is not None
    eng.check_session_free("s", "t", "")
    eng.check_session_free("s", "t", eng.config.cache_namespace_default)
    eng.add_request(history + [5], PARAMS, request_id="t2", cache_namespace=eng.config.cache_namespace_default,
                    session_id="s", tenant="t")
    assert drain(eng)["t2"].num_cached_tokens == len(history) - 1


def test_a_session_of_a_tenant_moved_to_another_namespace_is_refused(tiny: LoadedModel) -> None:
    """The tenant's session opened in the shared namespace "team"; the admin moves the tenant
    to its own namespace (the gateway now sends its turns there): the old session's next turn
    is refused rather than run in the namespace the tenant left, and closing it frees it."""
    eng = engine(tiny)
    sid = scoped_id(TENANT, "chat-1")
    eng.add_request(prompt_of(20, 1), PARAMS, request_id="t1", cache_namespace="team", session_id=sid,
                    tenant=TENANT)
    drain(eng)
    history = eng.session_history(sid)
    assert history is not None
    with pytest.raises(SessionNamespaceChanged) as refused:  # (the node's FAILED_PRECONDITION)
        eng.add_request(history + [5], PARAMS, request_id="t2", cache_namespace=OWN, session_id=sid, tenant=TENANT)
    assert "close it" in str(refused.value) and "team" not in str(refused.value)
    assert eng.session_history(sid) == history
    assert eng.close_session(sid) == len(history)
    eng.add_request(prompt_of(8, 3), PARAMS, request_id="t3", cache_namespace=OWN, session_id=sid, tenant=TENANT)
    assert drain(eng)["t3"].num_cached_tokens == 0  # a new session, in the tenant's namespace now
    eng.check_integrity()


def test_salted_session_routes_survive_a_scheduler_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler stores session routes by id (``flush_sessions``) and a restarted one takes
    a node's report of the sessions it holds (``recovery_report.session_row``: an id of its
    tenant): the salted ids do both. "chat/1" under salt u1 (the longest client id, with "/" and
    other scripts) and under no salt, on two nodes; the scheduler crashes and one node restarts
    meanwhile. u1's session, reported, continues; the unsalted one is refused ``session_lost``;
    the same id under a third salt was never opened: it opens."""
    from services.gateway_inputs import session_scope  # (not in fa49863)

    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    first = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=900.0)
    ann = GlobalScheduler.register_tenant(first, TenantSpec("ann", "standard"))[0].tenant_id
    client = "chat/1 " + "é" * 120 + "中" * 129
    assert len(client) == 256
    salted, plain, third = (session_scope(ann, salt, client) for salt in ("u1", "", "u3"))
    for rid, sid in (("r1", salted), ("r2", plain)):
        assert first.admit(ann, rid, session_id=sid).code == "OK"
    first.release("r1", finished)
    first.release("r2", finished)
    nodes = {first.session_nodes[sid][1]: sid for sid in (salted, plain)}
    assert set(nodes) == {"n0", "n1"}
    first.flush_sessions()
    first.store.close()  # killed

    def node_report(pid: int, sessions: list[tuple[str, str, bool]]) -> dict[str, Any]:
        return {"healthy": True, "failure": "", "pid": pid, "restarts": 0, "data_address": f"tcp://127.0.0.1:{9100 + pid}",
                "blocks": [], "sessions": sessions, "requests": []}

    holder = next(node for node, sid in nodes.items() if sid == salted)
    gone = next(node for node in nodes if node != holder)
    monkeypatch.setattr(admission, "actor_restarts", lambda: 1)
    monkeypatch.setattr(GlobalSchedulerService, "recover", lambda self, peers: (
        self.apply_node_report(holder, node_report(41, [(salted, ann, True)])),
        self.apply_node_report(gone, node_report(77, []))))

    async def restarted() -> None:
        second = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=900.0,
                                        peers=RecoveryPeers("kvstrata-test"))
        try:
            assert second.session_nodes == {salted: (ann, holder)}
            adm = second.admit(ann, "r3", session_id=salted)
            assert (adm.code, adm.node_id, adm.continues_session) == ("OK", holder, True)
            assert (second.admit(ann, "r4", session_id=plain).reason) == "session_lost"
            assert second.admit(ann, "r5", session_id=third).code == "OK"
        finally:
            second.close_data_plane()
            second.store.close()

    asyncio.run(restarted())


def test_an_unsalted_session_of_the_version_before_salts_survives_the_upgrade(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Review s36 R2 F1: sessions opened before the upgrade are stored (the scheduler's routes
    and lost-session marks) and held on nodes under fa49863's ``scoped_id(tenant, id)``. After
    the upgrade, an unsalted turn names them by the same id (``session_scope``): two sessions
    ("s1" on the node that restarts with the upgrade, "/b" -- a client id with "/" -- on the one
    that keeps running), stored by the old scheduler; the upgraded scheduler restarts and takes
    the nodes' reports. "s1"'s next turn is refused ABORTED ``session_lost`` (its history is
    gone, and the client is told), "/b" continues on its node, and both close by the client's
    id. On cfcfb59 both were named ``<tenant>//<id>``: "s1" opened a new, empty session (no
    ``session_lost``), "/b" a second one beside the held route, which stayed pinned."""
    from services.gateway_inputs import session_scope  # (not in fa49863)

    finished = {"prompt_tokens": 30, "completion_tokens": 8, "cached_tokens": {}, "prefill_tokens_per_s": 900.0}
    first = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=900.0)
    ann = GlobalScheduler.register_tenant(first, TenantSpec("ann", "standard"))[0].tenant_id
    before = {client: scoped_id(ann, client) for client in ("s1", "/b")}  # what fa49863's gateway sent
    for rid, sid in zip(("r1", "r2"), before.values()):  # (both running at once: one on each node)
        assert first.admit(ann, rid, session_id=sid).code == "OK"
    first.release("r1", finished)
    first.release("r2", finished)
    nodes = {client: first.session_nodes[sid][1] for client, sid in before.items()}
    assert set(nodes.values()) == {"n0", "n1"}
    first.flush_sessions()
    first.store.close()  # stopped for the upgrade

    def node_report(pid: int, sessions: list[tuple[str, str, bool]]) -> dict[str, Any]:
        return {"healthy": True, "failure": "", "pid": pid, "restarts": 0, "data_address": f"tcp://127.0.0.1:{9100 + pid}",
                "blocks": [], "sessions": sessions, "requests": []}

    monkeypatch.setattr(admission, "actor_restarts", lambda: 1)
    monkeypatch.setattr(GlobalSchedulerService, "recover", lambda self, peers: (
        self.apply_node_report(nodes["s1"], node_report(9, [])),  # restarted: s1's history is gone
        self.apply_node_report(nodes["/b"], node_report(41, [(before["/b"], ann, True)]))))

    async def upgraded() -> None:
        second = GlobalSchedulerService(str(tmp_path), {"n0": 8, "n1": 8}, session_ttl_s=900.0,
                                        peers=RecoveryPeers("kvstrata-test"))
        try:
            lost, kept = session_scope(ann, "", "s1"), session_scope(ann, "", "/b")
            refused = second.admit(ann, "r3", session_id=lost)
            assert (refused.code, refused.reason) == ("ABORTED", "session_lost")
            assert set(second.lost_of(ann)) == {lost}
            adm = second.admit(ann, "r4", session_id=kept)
            assert (adm.code, adm.node_id, adm.continues_session) == ("OK", nodes["/b"], True)
            assert second.session_nodes == {kept: (ann, nodes["/b"])}  # no second route of "/b"
            # a salted turn naming the same client ids is another session, opened anew
            salted = second.admit(ann, "r5", session_id=session_scope(ann, "u1", "s1"))
            assert (salted.code, salted.continues_session) == ("OK", False)
            assert client_session_id(lost, ann) == "s1" and client_session_id(kept, ann) == "/b"
            assert (lost, kept) == (before["s1"], before["/b"])  # the ids are the old ones
        finally:
            second.close_data_plane()
            second.store.close()

    asyncio.run(upgraded())
