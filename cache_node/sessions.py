"""Agent sessions: KV pinned between turns so a next turn prefills only its new tokens.

Under a compressing KV policy the session keeps the turn's policy-managed state as well: the
sequence's ``SequenceKV`` (device part: sinks, window, sketch, recall region or kept tokens,
charge blocks; host part: demoted sentences or cold codes) with its block table. The next
turn of the same policy whose prompt extends the history continues from it: it prefills only
its new tokens, which attend through the policy over the kept state and are compressed as any
prefill is. A turn that does not extend the history, or names another policy, falls back to
prefilling the whole history (``SessionTable.num_fallbacks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.sequence import Sequence

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV


@dataclass
class Session:
    """What a session keeps between turns.

    ``token_ids``: the whole history (prompts + outputs). ``num_computed_tokens``: history
    tokens whose KV sits in ``blocks`` (all but the last output token). ``blocks`` hold one
    reference each while the session is idle; an active turn borrows them. ``kv``: the last
    turn's policy state (None under the full cache) under policy spec ``policy``; when it is
    compacted, ``blocks`` hold its layout (``num_evicted_tokens`` of the computed tokens are
    no longer in them) and its charge blocks stay held, so the pool and the tenant still pay
    for what the policy keeps while the session is idle.
    """

    session_id: str
    tenant: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    active_request: str | None = None
    last_used_s: float = field(default_factory=time.monotonic)
    kv: SequenceKV | None = None
    policy: str = ""
    num_evicted_tokens: int = 0

    @property
    def num_held_blocks(self) -> int:
        """Pool blocks the idle session holds: its blocks plus its policy's charge blocks."""
        return len(self.blocks) + (len(self.kv.charge_blocks) if self.kv is not None else 0)

    @property
    def compacted(self) -> bool:
        """The blocks hold a policy's compacted layout (usable only with its ``kv``)."""
        return self.kv is not None and self.kv.compacted


class SessionTable:
    """Per-node session registry; the engine calls it when turns start and end."""

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.sessions: dict[str, Session] = {}
        self.num_policy_continuations = 0  # turns that continued from a compacted policy state
        self.num_fallbacks = 0  # turns that found a compacted state they could not continue

    def attach(self, seq: Sequence) -> None:
        """Give ``seq`` its session's pinned blocks when its prompt extends the history.

        Raises:
            ValueError: the session belongs to another tenant or already has a turn running.
        """
        sess = self.sessions.get(seq.session_id or "")
        if sess is None:
            self.sessions[seq.session_id] = Session(seq.session_id, seq.tenant, active_request=seq.request_id)
            return
        if sess.tenant != seq.tenant:
            raise PermissionError(f"session {seq.session_id!r} belongs to another tenant")
        if sess.active_request is not None:
            raise ValueError(f"session {seq.session_id!r} already has a turn running")
        sess.active_request = seq.request_id
        history = sess.token_ids
        extends = seq.prompt_token_ids[: len(history)] == history and len(seq.prompt_token_ids) > len(history)
        if sess.compacted:
            if extends and seq.policy == sess.policy:
                self._continue_policy_state(sess, seq)
                return
            self.num_fallbacks += 1
        elif sess.blocks and extends:
            self._drop_kv(sess)  # plain KV: any policy may attend it
            seq.block_table, sess.blocks = sess.blocks, []
            seq.num_computed_tokens = sess.num_computed_tokens
            seq.num_cached_tokens = sess.num_computed_tokens
            return
        self._release(sess)

    def _continue_policy_state(self, sess: Session, seq: Sequence) -> None:
        """Hand the session's compacted policy state and its blocks to ``seq``: the turn's
        fresh ``SequenceKV`` is replaced by the kept one, whose budget is recomputed from the
        new prompt at its end (``SequenceKV.after_step``), as a from-scratch turn's would be."""
        kv = sess.kv
        assert kv is not None
        kv.seq, seq.kv = seq, kv
        kv.budget = None
        seq.block_table, sess.blocks, sess.kv = sess.blocks, [], None
        seq.num_computed_tokens = seq.num_cached_tokens = sess.num_computed_tokens
        seq.num_evicted_tokens = sess.num_evicted_tokens
        self.num_policy_continuations += 1

    def detach(self, seq: Sequence, aborted: bool) -> bool:
        """End a turn. Returns True when the session took over the sequence's blocks.

        A finished turn becomes the new history: its blocks stay pinned, with its policy state
        (``seq.kv``, compacted or not) when it ran under one. An aborted turn leaves the history
        as it was and its blocks (and any policy state it continued from) go back to the pool:
        the next turn prefills the whole history.
        """
        sess = self.sessions.get(seq.session_id or "")
        if sess is None:
            return False
        sess.active_request = None
        sess.last_used_s = time.monotonic()
        if aborted:
            if not sess.token_ids and not sess.blocks:  # its first turn: nothing to keep
                # (a fresh-user trial: sessions of aborted first turns stayed open, empty,
                # until their TTL)
                del self.sessions[sess.session_id]
            return False
        self._release(sess)
        sess.token_ids = seq.all_token_ids
        sess.num_computed_tokens = seq.num_computed_tokens
        sess.num_evicted_tokens = seq.num_evicted_tokens
        sess.blocks, seq.block_table = seq.block_table, []
        sess.kv, seq.kv, sess.policy = seq.kv, None, seq.policy
        return True

    def close(self, session_id: str) -> int:
        """Free a session. Returns the number of history tokens it held (0 when unknown)."""
        sess = self.sessions.pop(session_id, None)
        if sess is None:
            return 0
        self._release(sess)
        return len(sess.token_ids)

    def tenants(self) -> set[str]:
        """Tenants with a session on this node (idle or running a turn)."""
        return {sess.tenant for sess in self.sessions.values()}

    def lru_idle(self) -> str | None:
        """The idle session holding pinned blocks that was used longest ago (None if none)."""
        idle = [s for s in self.sessions.values() if s.blocks and s.active_request is None]
        return min(idle, key=lambda s: s.last_used_s).session_id if idle else None

    def unpin(self, session_id: str) -> list[KVBlock]:
        """Release an idle session's blocks (kept matchable as cached blocks) and return them.

        The history stays: the next turn finds its KV through the prefix cache and the tiers
        below. A compacted policy state is not moved to a lower tier: its blocks match no
        token prefix, so it is dropped whole (blocks, charge blocks, host-tier sentences) and
        [] is returned; the next turn prefills the history again. Returns [] for an unknown
        session or one with a turn running.
        """
        sess = self.sessions.get(session_id)
        if sess is None or sess.active_request is not None:
            return []
        blocks = [] if sess.compacted else sess.blocks
        self._release(sess)
        return blocks

    def idle_policy_states(self) -> list[SequenceKV]:
        """The policy states idle sessions keep (their charge blocks stay held)."""
        return [s.kv for s in self.sessions.values() if s.kv is not None and s.active_request is None]

    def expire(self, ttl_s: float) -> list[str]:
        """Close idle sessions not used for ``ttl_s`` seconds; returns their ids."""
        now = time.monotonic()
        old = [
            s.session_id
            for s in self.sessions.values()
            if s.active_request is None and now - s.last_used_s > ttl_s
        ]
        for sid in old:
            self.close(sid)
        return old

    def _release(self, sess: Session) -> None:
        self._drop_kv(sess)
        self.kv_manager.pool.free(list(reversed(sess.blocks)))
        sess.blocks = []
        sess.num_evicted_tokens = 0

    @staticmethod
    def _drop_kv(sess: Session) -> None:
        """Free the kept policy state: charge blocks and what it holds in lower tiers."""
        if sess.kv is not None:
            sess.kv.reset()
            sess.kv = None
