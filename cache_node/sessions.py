"""Agent sessions: KV pinned between turns so a next turn prefills only its new tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.sequence import Sequence


@dataclass
class Session:
    """What a session keeps between turns.

    ``token_ids``: the whole history (prompts + outputs). ``num_computed_tokens``: history
    tokens whose KV sits in ``blocks`` (all but the last output token). ``blocks`` hold one
    reference each while the session is idle; an active turn borrows them.
    """

    session_id: str
    tenant: str
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    active_request: str | None = None
    last_used_s: float = field(default_factory=time.monotonic)


class SessionTable:
    """Per-node session registry; the engine calls it when turns start and end."""

    def __init__(self, kv_manager: KVCacheManager) -> None:
        self.kv_manager = kv_manager
        self.sessions: dict[str, Session] = {}

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
        if sess.blocks and seq.prompt_token_ids[: len(history)] == history and len(
            seq.prompt_token_ids
        ) > len(history):
            seq.block_table, sess.blocks = sess.blocks, []
            seq.num_computed_tokens = sess.num_computed_tokens
            seq.num_cached_tokens = sess.num_computed_tokens
        else:
            self._release(sess)

    def detach(self, seq: Sequence, aborted: bool, reusable: bool = True) -> bool:
        """End a turn. Returns True when the session took over the sequence's blocks.

        A finished turn becomes the new history: its blocks stay pinned, or, when they cannot
        serve as the next turn's prefix (``reusable`` False: a compression policy rewrote the
        layout), go back to the pool and the next turn prefills the whole history. An aborted
        turn leaves the history as it was and its blocks go back to the pool.
        """
        sess = self.sessions.get(seq.session_id or "")
        if sess is None:
            return False
        sess.active_request = None
        sess.last_used_s = time.monotonic()
        if aborted:
            return False
        self._release(sess)
        sess.token_ids = seq.all_token_ids
        if not reusable:
            sess.num_computed_tokens = 0
            return False
        sess.num_computed_tokens = seq.num_computed_tokens
        sess.blocks, seq.block_table = seq.block_table, []
        return True

    def close(self, session_id: str) -> int:
        """Free a session. Returns the number of history tokens it held (0 when unknown)."""
        sess = self.sessions.pop(session_id, None)
        if sess is None:
            return 0
        self._release(sess)
        return len(sess.token_ids)

    def lru_idle(self) -> str | None:
        """The idle session holding pinned blocks that was used longest ago (None if none)."""
        idle = [s for s in self.sessions.values() if s.blocks and s.active_request is None]
        return min(idle, key=lambda s: s.last_used_s).session_id if idle else None

    def unpin(self, session_id: str) -> list[KVBlock]:
        """Release an idle session's blocks (kept matchable as cached blocks) and return them.

        The history stays: the next turn finds its KV through the prefix cache and the tiers
        below. Returns [] for an unknown session or one with a turn running.
        """
        sess = self.sessions.get(session_id)
        if sess is None or sess.active_request is not None:
            return []
        blocks = sess.blocks
        self._release(sess)
        return blocks

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
        self.kv_manager.pool.free(list(reversed(sess.blocks)))
        sess.blocks = []
