"""Agent sessions: KV pinned between turns so a next turn prefills only its new tokens.

Under a compressing KV policy the session keeps the turn's policy-managed state as well: the
sequence's ``SequenceKV`` (device part: sinks, window, sketch, recall region or kept tokens,
charge blocks; host part: demoted sentences or cold codes) with its block table. The next
turn of the same policy whose prompt extends the history continues from it: it prefills only
its new tokens, which attend through the policy over the kept state and are compressed as any
prefill is. A turn that does not extend the history, or names another policy, falls back to
prefilling the whole history (``SessionTable.num_fallbacks``).

While such a turn (under a compressing policy) runs, the session keeps the history's KV: its
blocks (shared with the turn, which copies them on its first compaction) and its policy state
(the turn runs from a fork: ``SequenceKV.fork``). A turn that loses its KV (preempted, or its
waiting blocks taken) restarts from that history (``Sequence.restart``, ``SessionKept``), so
it recomputes only its own tokens and decodes as never preempted; an aborted turn leaves the
history as it was, KV included. Only the engine's last resort for blocks drops a kept history
(``SessionKept.drop``).

A block whose hash is registered in the prefix cache is never written again: a turn lent the
history's partly filled last block fills it with its own tokens, and the cache may hash it; a
history that keeps such a block (the turn cancelled, undone or restarted) drops it before a
turn writes past the history (``SessionTable._seal``), as a cut history does (``cut``), and
computes its tokens in it again.

Every path that drops a session's history KV for another reason than the session's close (an
idle session unpinned or demoted for another request, its host-tier state reclaimed, a turn's
compaction that could not settle, a kept history taken back, a fork that failed, an undo whose
kept history went) goes through ``SessionTable.lose``, which records it on the session
(``Session.lost``); the next turn that would have continued from that KV carries
``policy_stats["session_state_dropped"]``, as a restarted turn does (``Sequence.restart``).
docs/architecture.md, 'Cache node step loop' says which turns are marked and why.

A session belongs to the tenant and the cache namespace of the turn that opened it
(``Session.namespace``; the gateway's namespace carries the request's ``cache_salt``): a turn of
another tenant or another namespace is refused PermissionError, the session untouched
(``check_turn``; review s36 E1).

A turn's history holds the tokens of the reply its client got, no others: when the cache node
cut the reply's text (a stop string, whose tokens and the text after it the client never got)
or a trailing token renders as nothing in the kept reply, it cuts the history to the output's
tokens the kept text covers and appends the rest of that text tokenized (``SessionTable.cut``,
``cut_turn``); KV past the cut is freed, never kept for tokens the history no longer holds. A
chat turn's reply is held as the chat template's rendering of its text tokenizes it (the
tokens a request sending the conversation without the session gets): the output's longest
prefix that is those tokens stays, the rest is replaced (review 30a F2: "\\n\\n" generated as one
token, two in the rendering), and where the reply's first characters tokenize with the
prompt's last text, the cut reaches into the prompt (``cut_turn``'s ``lead``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache_node.block import KVBlock
from cache_node.kv_cache_manager import KVCacheManager
from cache_node.outputs import SessionBusy, SessionNamespaceChanged
from cache_node.sequence import Sequence
from cache_node.session_ids import client_session_id

if TYPE_CHECKING:
    from cache_node.kv_state import SequenceKV

log = logging.getLogger(__name__)


@dataclass
class History:
    """A session's history as it was before the turn that just ended: kept (its blocks'
    references and policy state held) until the next engine step, so that a turn cancelled
    while its last step computed is undone to exactly that state (``SessionTable.rewind``)."""

    token_ids: list[int]
    num_computed_tokens: int
    num_evicted_tokens: int
    blocks: list[KVBlock]
    kv: SequenceKV | None
    policy: str
    namespace: str


@dataclass(frozen=True)
class LostState:
    """A session history's KV dropped while the session kept it (``SessionTable.lose``): its
    last turn's policy spec ``policy``, and whether the KV was that policy's compacted layout
    (``compacted``: usable only by a turn of the same policy)."""

    policy: str
    compacted: bool


@dataclass
class Session:
    """What a session keeps between turns.

    ``token_ids``: the whole history (prompts + outputs). ``num_computed_tokens``: history
    tokens whose KV sits in ``blocks`` (all but the last output token). ``blocks`` hold one
    reference each while the session is idle; an active turn borrows them. ``kv``: the last
    turn's policy state (None under the full cache) under policy spec ``policy``; when it is
    compacted, ``blocks`` hold its layout (``num_evicted_tokens`` of the computed tokens are
    no longer in them) and its charge blocks stay held, so the pool and the tenant still pay
    for what the policy keeps while the session is idle. ``kept_for``: the running turn under
    a compressing policy that borrows ``blocks`` and ``kv`` while the session keeps them.
    ``lost``: the history's KV was dropped (``SessionTable.lose``) and no turn has run since,
    or the last turn was marked and its policy state, rebuilt, descends from that loss;
    ``previous_lost``: the same for the history kept to undo the last turn (``rewind``).
    ``opened_by``: the request id of the turn that opened the session here (its first).
    ``num_computed_tokens`` is less when the history was cut (``SessionTable.cut``): the tokens
    past it have no KV, and the next turn computes them. ``cut``: a cut of the running turn's
    history the cache node asked for before the engine handed the turn over (its compaction put
    off: ``LLMEngine._settling``): (the turn's request id, the history's length to keep, the
    tokens to append); ``detach`` makes it. ``ending``: the request id of the turn that ended
    here between steps (a stop string: ``LLMEngine.abort_request``) whose last output the engine
    has yet to report; until it does, the session counts as running that turn (``attach``
    refuses another: ``SessionBusy``), for the cache node cuts the history to the reply its
    client got when it delivers that output (``SessionTable.hold_until_reported``).
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
    kept_for: Sequence | None = None
    namespace: str = ""  # the cache namespace it was opened under, which every turn of it keeps (``check_turn``)
    previous: History | None = None  # the history before the turn that just ended (``detach``)
    lost: LostState | None = None
    previous_lost: LostState | None = None
    opened_by: str = ""
    cut: tuple[str, int, list[int]] | None = None
    ending: str | None = None

    @property
    def num_held_blocks(self) -> int:
        """Pool blocks the idle session holds: its blocks plus its policy's charge blocks."""
        return len(self.blocks) + (len(self.kv.charge_blocks) if self.kv is not None else 0)

    @property
    def compacted(self) -> bool:
        """The blocks hold a policy's compacted layout (usable only with its ``kv``)."""
        return self.kv is not None and self.kv.compacted


def check_turn(sess: Session, session_id: str, tenant: str, namespace: str) -> None:
    """Refuse a turn of ``tenant`` under cache ``namespace`` on ``sess`` when the session is
    another tenant's, or was opened under another namespace (``Session.namespace``). The
    message names neither the other tenant nor the other namespace.

    Regression (review s36 E1): only the tenant was compared, so a turn under another
    ``cache_salt`` of the tenant continued a session of the same id opened under the first
    salt: it was answered over that salt's private conversation (its pinned history KV), and
    could extend or rewrite it, which the salt's promise (requests share cached blocks only
    within one namespace and salt) rules out.

    Raises:
        PermissionError: the session is another tenant's.
        SessionNamespaceChanged (a PermissionError): it was opened under another namespace.
    """
    if sess.tenant != tenant:
        raise PermissionError(f"session {session_id!r} belongs to another tenant")
    if sess.namespace != namespace:
        raise SessionNamespaceChanged(
            f"session {client_session_id(session_id, tenant)!r} was opened under another cache namespace "
            "(another cache_salt, or the tenant's cache namespace changed since): its turns must keep the "
            "namespace they opened it under; close it (gRPC CloseSession, HTTP DELETE "
            "/v1/sessions/{session_id}) and start a new session")


class SessionTable:
    """Per-node session registry; the engine calls it when turns start and end."""

    def __init__(self, kv_manager: KVCacheManager, copy_block: Callable[[int, int], None] | None = None) -> None:
        """``copy_block(src, dst)``: copy one pool block's KV (all layers, K and V) to another
        (``_seal`` keeps a history's partial block so; without it the block is dropped)."""
        self.kv_manager = kv_manager
        self.copy_block = copy_block
        self.sessions: dict[str, Session] = {}
        self._parked: set[str] = set()  # sessions holding a ``previous`` history (``drop_previous``)
        self.num_policy_continuations = 0  # turns that continued from a compacted policy state
        self.num_fallbacks = 0  # turns that found a compacted state they could not continue
        self.num_states_dropped = 0  # turns that ended marked ``session_state_dropped``

    def attach(self, seq: Sequence) -> None:
        """Give ``seq`` its session's pinned blocks when its prompt extends the history.

        A session is bound to the tenant and the cache namespace of the turn that opened it
        (``Session.namespace``: the tenant's namespace under the turn's ``cache_salt``): a turn
        of another tenant, or of another namespace (another salt; its tenant moved to another
        namespace since), never reads, extends or ends its history (``check_turn``).

        Raises:
            PermissionError: the session belongs to another tenant or another cache namespace;
                the session is left as it was.
            SessionBusy: the session already has a turn running.
        """
        sess = self.sessions.get(seq.session_id or "")
        if sess is None:
            self.sessions[seq.session_id] = Session(seq.session_id, seq.tenant, active_request=seq.request_id,
                                                    namespace=seq.cache_namespace, opened_by=seq.request_id)
            return
        check_turn(sess, seq.session_id, seq.tenant, seq.cache_namespace)
        if sess.active_request is not None or sess.ending is not None:
            raise SessionBusy(client_session_id(seq.session_id, seq.tenant))
        sess.active_request = seq.request_id
        self._seal(sess)  # (a history whatever path left it: the turn writes past its end)
        history = sess.token_ids
        extends = seq.prompt_token_ids[: len(history)] == history and len(seq.prompt_token_ids) > len(history)
        if extends and seq.sampling_params.prompt_logprobs is not None:
            # it needs every prompt position's logits: it computes its history again (a
            # compressing policy's turn that would have continued from the kept state says so)
            if sess.compacted and seq.policy == sess.policy:
                seq.mark_state_dropped()
            extends = False
        lost = sess.lost  # (kept until a turn's end replaces the history: an aborted turn leaves it)
        if lost is not None and extends and seq.kv is not None and (not lost.compacted or seq.policy == lost.policy):
            seq.mark_state_dropped()  # it would have continued from the KV ``lost`` records
        if sess.compacted:
            if extends and seq.policy == sess.policy:
                if self._keep_for(sess, seq):
                    self.num_policy_continuations += 1
                return
            self.num_fallbacks += 1
        elif sess.blocks and extends:
            self._drop_kv(sess)  # plain KV: any policy may attend it
            if seq.kv is not None:  # a compressing policy: its turn must restart from it
                self._keep_for(sess, seq)
                return
            # a full-cache turn is lent the history's blocks too (one more reference each): an
            # aborted or cut-short turn leaves the history its KV, and a preempted one
            # continues from it. Regression (review s34 A L1): the turn took the blocks over, so
            # cancelling it freed the history's KV while the session kept counting it (no
            # blocks, no ``lost``): its next turn prefilled the whole history again and, under
            # a statistics-reading policy, decoded other tokens, unmarked
            sess.kept_for, seq.kept = seq, SessionKept(self, sess)
            self.lend(sess, seq)  # (no policy state to fork: it cannot fail)
            return
        self._release(sess)

    def _keep_for(self, sess: Session, seq: Sequence) -> bool:
        """Keep the session's history KV while ``seq`` runs from it (``lend``). False when
        the policy could not fork the state: the history is dropped and ``seq`` computes its
        whole prompt.

        Regression: the turn took the history's blocks and policy state over; preempted, it
        lost them and recomputed the whole history with its own prompt, compressed at once
        (with the new turn in view), so it decoded other tokens than never preempted.
        """
        sess.kept_for, seq.kept = seq, SessionKept(self, sess)
        seq.continues_state = True  # (plain history KV too: recomputed cold it decodes otherwise)
        if self.lend(sess, seq):
            return True
        seq.mark_state_dropped()
        return False

    def lend(self, sess: Session, seq: Sequence) -> bool:
        """Give ``seq`` (holding no blocks) one more reference on each of the session's blocks
        and, when the session keeps a policy state, a fork of it whose budget is recomputed
        from the turn's prompt at its end (``SequenceKV.after_step``), as a from-scratch
        turn's would be; ``seq`` continues from the history's end. The fork takes the kept
        state's charge blocks over (it shares the bytes they pay for) until the turn ends.
        False (the kept history dropped, ``seq`` holding nothing of it) when the policy's
        ``fork`` raised."""
        pool = self.kv_manager.pool
        kv = None
        self._seal(sess)  # (a restarted turn's first run may have filled and cached the last block)
        pool.touch(sess.blocks)
        seq.block_table = list(sess.blocks)
        try:
            if sess.kv is not None:
                sess.kv.hand_charge_over()  # the fork pays for the bytes they share
                kv = sess.kv.fork(seq)  # (its num_evicted_tokens is the session's, set below)
                kv.budget = None
                kv.settle_charge()
        except Exception:
            log.exception("session %s: request %s could not fork the kept history", sess.session_id,
                          seq.request_id)
            if kv is not None:
                kv.reset()
            pool.free(seq.block_table[::-1])
            seq.block_table, seq.num_evicted_tokens = [], 0
            self.lose(sess)
            return False
        if kv is not None:
            seq.kv = kv
        seq.num_computed_tokens = seq.num_cached_tokens = sess.num_computed_tokens
        seq.num_evicted_tokens = sess.num_evicted_tokens
        return True

    def detach(self, seq: Sequence, aborted: bool) -> bool:
        """End a turn. Returns True when the session took over the sequence's blocks.

        A finished turn becomes the new history: its blocks stay pinned, with its policy state
        (``seq.kv``, compacted or not) when it ran under one. An aborted turn leaves the history
        as it was: its blocks go back to the pool, and the next turn continues from the history
        KV the session kept for it (a turn under a compressing policy), else prefills the whole
        history. A turn that is not its session's running turn (the session was closed while
        it ran, and perhaps opened again by another turn) leaves the session alone.

        Regression: the session was looked up by id alone, so after a close and a reopen the old
        turn's end became the new session's history (the new turn's lost) and cleared its
        running turn, letting a second turn attach alongside it.
        """
        if seq.policy_stats.get("session_state_dropped"):
            self.num_states_dropped += 1
        sess = self.sessions.get(seq.session_id or "")
        if sess is None or sess.active_request != seq.request_id:
            return False
        sess.active_request = None
        sess.last_used_s = time.monotonic()
        cut, sess.cut = sess.cut, None
        if sess.kept_for is seq:
            sess.kept_for = seq.kept = None
            if aborted and sess.kv is not None:  # the history pays for its state again
                self.kv_manager.free(seq)
                sess.kv.settle_charge()
        if aborted:
            if not sess.token_ids and not sess.blocks:  # its first turn: nothing to keep
                # (a fresh-user trial: sessions of aborted first turns stayed open, empty,
                # until their TTL)
                del self.sessions[sess.session_id]
            else:  # the turn, lent the history's blocks, may have filled and cached its last one
                self._seal(sess)
            return False
        self._park(sess)
        sess.token_ids = seq.all_token_ids
        sess.num_computed_tokens = seq.num_computed_tokens
        sess.num_evicted_tokens = seq.num_evicted_tokens
        sess.blocks, seq.block_table = seq.block_table, []
        sess.kv, seq.kv, sess.policy = seq.kv, None, seq.policy
        sess.namespace = seq.cache_namespace
        # the turn's KV replaces the history's; a marked turn rebuilt its policy state, so the
        # state it hands on descends from the loss and the turns continuing from it are marked
        # too (verification 22: a marked turn with the same tokens, then an unmarked one with
        # others)
        marked = seq.policy_stats.get("session_state_dropped") and sess.kv is not None
        sess.lost = LostState(sess.policy, sess.compacted) if marked else None
        if not sess.blocks and sess.num_computed_tokens:
            # a turn cut short (its policy's codes outgrew the pool: ``Preemption``) freed its
            # blocks and kept its count: the history holds no KV, and records the loss (review
            # s34 A L1: it counted tokens it had no blocks for, unrecorded)
            self._drop_kv(sess)
            sess.num_computed_tokens = sess.num_evicted_tokens = 0
            sess.lost = LostState(sess.policy, False)
        if cut is not None and cut[0] == seq.request_id:
            self.cut(sess, cut[1], cut[2])
        return True

    def hold_until_reported(self, seq: Sequence) -> None:
        """``seq``, a turn its session keeps, ended between steps (``LLMEngine.abort_request``
        with reason "stop": the cache node matched a stop string in its text), and the engine
        reports its end with the next step's outputs: until then (``reported``) the session
        counts as running it (``Session.ending``), and a next turn is refused (``SessionBusy``,
        ABORTED on the node), as it is while the turn runs. A session whose history is no
        longer that turn's end (closed meanwhile, opened again) is left alone.

        Regression (F7): a next turn that reached the session in between found it idle, its
        history holding the whole output, and was started on it; the cut the cache node asks
        for when the end is reported (``cut_turn``: the stop string's tokens, which the client
        never got) then found that turn running and was skipped, so it and every later turn
        attended to tokens no client ever got (and, the node's kept messages not holding the
        ended turn yet, it was rendered without that turn, or refused as an empty conversation).
        """
        sess = self.sessions.get(seq.session_id or "")
        if sess is None or sess.ending is not None:
            return
        if sess.active_request == seq.request_id or (sess.active_request is None
                                                     and sess.token_ids == seq.all_token_ids):
            sess.ending = seq.request_id

    def reported(self, seq: Sequence) -> None:
        """The engine reported the end of ``seq`` (its last output): its session takes a next
        turn again (``hold_until_reported``)."""
        sess = self.sessions.get(seq.session_id or "")
        if sess is not None and sess.ending == seq.request_id:
            sess.ending = None

    def cut_turn(self, session_id: str, request_id: str, prompt_len: int, output: tuple[int, ...], keep: int,
                 tail: list[int], lead: tuple[int, ...] | list[int] = (), running: Sequence | None = None) -> bool:
        """The turn ``request_id`` of ``session_id`` (its prompt of ``prompt_len`` tokens, its
        ``output``) ended, and its client got the text of its first ``keep`` output tokens and
        then that of ``tail``: the history keeps those tokens (``cut``), at once when the turn's
        end is the history, else when the engine hands the turn over (``Session.cut``: its
        compaction was put off; ``running``, the finished turn's sequence, gives its prompt).
        ``lead``: the ids the prompt ends with (checked), which a negative ``keep`` cuts into
        (a reply whose first characters a rendering tokenizes with the text before them).
        False, changing nothing, when the session is neither, or the prompt does not end with
        ``lead``.
        """
        sess = self.sessions.get(session_id)
        lead = list(lead)
        if sess is None or len(lead) > prompt_len or not -len(lead) <= keep <= len(output):
            return False
        if sess.active_request == request_id:  # (finished: the engine hands it over later)
            if lead and (running is None or running.request_id != request_id
                         or running.prompt_token_ids[prompt_len - len(lead):prompt_len] != lead):
                return False
            sess.cut = (request_id, prompt_len + keep, list(tail))
            return True
        if (sess.active_request is not None or len(sess.token_ids) != prompt_len + len(output)
                or sess.token_ids[prompt_len:] != list(output)
                or sess.token_ids[prompt_len - len(lead):prompt_len] != lead):
            return False
        self.cut(sess, prompt_len + keep, tail)
        return True

    def cut(self, sess: Session, length: int, tail: list[int]) -> None:
        """Cut idle ``sess``'s history to its first ``length`` tokens and append ``tail`` (no KV).

        KV of the tokens past the cut is freed: the blocks past it go back to the pool (full
        ones stay cached, their tokens as they were), and so does the block the cut falls in
        when it is cached or shared (the next turn writes the slots past the cut: a cached
        block would then match its old tokens with other KV), whose first tokens the next turn
        computes again. A policy state cannot be cut to a token prefix: the session loses it
        (``lose``: its next turn of a compressing policy is marked) and keeps the tokens alone.
        Cut at or past the computed tokens (a stop string within the last output token, whose
        KV is never computed), the KV stays.

        Regression: the history kept the stop string's tokens, which the client never got, so
        the next turn attended to them and answered otherwise than the same conversation sent
        without the session.
        """
        if length < sess.num_computed_tokens:
            if sess.kv is not None:
                self.lose(sess)
                sess.num_computed_tokens = 0
            else:
                bs = self.kv_manager.block_size
                kept = min(-(-length // bs), len(sess.blocks))  # (regression, review 30i F1: unpinned)
                if length % bs and kept and (sess.blocks[kept - 1].block_hash is not None
                                             or sess.blocks[kept - 1].ref_cnt > 1):
                    kept -= 1
                past, sess.blocks = sess.blocks[kept:], sess.blocks[:kept]
                self.kv_manager.pool.free(past[::-1])
                sess.num_computed_tokens = min(length, kept * bs)
        sess.token_ids = sess.token_ids[:length] + list(tail)

    def rewind(self, session_id: str, history: list[int] | None, prompt_len: int, output: tuple[int, ...]) -> bool:
        """Undo the turn that just finished in ``session_id`` (its prompt of ``prompt_len``
        tokens and its ``output`` are the session's history now): the history is ``history``
        again, with the KV and policy state it had before the turn when the session still
        keeps them (``Session.previous``, until the next engine step), else without KV (its
        full blocks stay in the prefix cache, and the next turn prefills the rest); a first
        turn (``history`` None or empty) closes the session, as its abort would have. False,
        changing nothing, when the session is not idle at the end of that turn.

        Regression (hangs review N1): a client's cancel that landed while its turn's last step
        computed left the turn in the history (tokens the client never got) while the cache
        node's kept chat messages missed it; the node now rewinds such a turn.
        """
        sess = self.sessions.get(session_id)
        if (sess is None or sess.active_request is not None or len(sess.token_ids) != prompt_len + len(output)
                or sess.token_ids[prompt_len:] != list(output)):
            return False
        if not history:
            self.close(session_id)
            return True
        previous, sess.previous = sess.previous, None
        self._release(sess)
        if previous is not None and previous.token_ids == list(history) and previous.blocks:
            # the history's KV and policy state as the turn found them (hangs review 20 W2: they
            # were dropped, and the next turn prefilled and compressed the history again, decoding
            # other tokens than after a cancel that landed one step earlier)
            sess.token_ids, sess.num_computed_tokens = previous.token_ids, previous.num_computed_tokens
            sess.num_evicted_tokens, sess.blocks = previous.num_evicted_tokens, previous.blocks
            sess.kv, sess.policy, sess.namespace = previous.kv, previous.policy, previous.namespace
            if sess.kv is not None:  # it handed its charge blocks over to the turn (``lend``)
                sess.kv.settle_charge()
            sess.lost = sess.previous_lost = None
            self._seal(sess)  # the undone turn, lent these blocks, may have filled and cached the last
            return True
        if previous is not None:
            self._free_history(previous)
        # without its KV: marked when the undo's kept history was dropped (``_free_previous``)
        sess.lost, sess.previous_lost = sess.previous_lost, None
        sess.token_ids, sess.num_computed_tokens = list(history), 0
        return True

    def drop_previous(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        """Free every history kept for a ``rewind`` (``Session.previous``) but those of the
        sessions in ``keep``: the engine calls it once the cache node has delivered (or
        undone) every turn that ended (``LLMEngine.release_undo``), and first when it needs
        blocks."""
        for session_id in list(self._parked):
            if session_id in keep:
                continue
            self._parked.discard(session_id)
            sess = self.sessions.get(session_id)
            if sess is not None:
                self._free_previous(sess)

    def drop_history(self, sess: Session) -> None:
        """Free the history KV ``sess`` keeps (its turn holds its own references): ``lose``."""
        self.lose(sess)

    def lose(self, sess: Session) -> None:
        """Drop the history KV of ``sess`` (blocks, policy state, its undo's kept history) for
        another reason than the session's close, and record it (``Session.lost``): the next
        turn whose prompt extends the history under a compressing policy (the same one when the
        KV was a compacted layout) would have continued from that KV, and carries
        ``policy_stats["session_state_dropped"]`` (``attach``). Every path that drops a
        session's KV but its close, the fallback of a turn that cannot use it, a finished
        turn's new history and an undone turn's own KV calls this, so none leaves a turn
        unmarked. A session holding no KV keeps the loss it recorded before."""
        if sess.blocks or sess.kv is not None:
            sess.lost = LostState(sess.policy, sess.compacted)
        self._release(sess)

    def check_integrity(self) -> None:
        """Raise RuntimeError when an idle session counts history KV it holds no blocks for
        (``num_computed_tokens - num_evicted_tokens`` past its blocks' slots): every path that
        drops its blocks resets the count (``_release``) or records the loss (review s34 A L1:
        a cancelled full-cache turn and a turn cut short left the count with no blocks)."""
        bs = self.kv_manager.block_size
        for sess in self.sessions.values():
            if sess.active_request is None and \
                    sess.num_computed_tokens - sess.num_evicted_tokens > len(sess.blocks) * bs:
                raise RuntimeError(f"session {sess.session_id[:100]!r} counts {sess.num_computed_tokens} computed "
                                   f"tokens ({sess.num_evicted_tokens} evicted) in {len(sess.blocks)} blocks")

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

    def unpin(self, session_id: str) -> list[KVBlock]:
        """Release an idle session's blocks (kept matchable as cached blocks) and return them.

        The history stays: the next turn finds its KV through the prefix cache and the tiers
        below. A compacted policy state is not moved to a lower tier: its blocks match no
        token prefix, so it is dropped whole (blocks, charge blocks, host-tier sentences) and
        [] is returned; the next turn prefills the history again. Either way the session no
        longer keeps its KV (``lose``): its next turn under a compressing policy is marked.
        Returns [] for an unknown session or one with a turn running.
        """
        sess = self.sessions.get(session_id)
        if sess is None or sess.active_request is not None:
            return []
        blocks = [] if sess.compacted else sess.blocks
        self.lose(sess)
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
        if sess.kept_for is not None:  # its running turn restarts from scratch now
            sess.kept_for.kept = sess.kept_for = None
        self._free_previous(sess)
        self._drop_kv(sess)
        self.kv_manager.pool.free(list(reversed(sess.blocks)))
        sess.blocks = []
        # no KV left: none of the history is computed (review 30i F1: a stop-string turn's
        # session unpinned before the next step delivered its end kept its count, and the
        # node's cut of its history indexed an empty block list: IndexError, the step loop died)
        sess.num_evicted_tokens = sess.num_computed_tokens = 0

    def _seal(self, sess: Session) -> None:
        """Drop the blocks of ``sess``'s history that its next turn would write into (from the
        one holding the first slot past the history's KV) when one of them carries a
        prefix-cache hash: the cache says that block holds the KV of the tokens it was hashed
        with, and a write of other tokens' KV into its free slots would hand that KV to every
        later hit on those tokens (another tenant's, where a namespace is shared). The history's
        partial block is copied into a fresh block of its own (``copy_block``: the history keeps
        every token's KV) and the hashed one goes back to the pool, still matchable, its KV as
        cached; without ``copy_block`` or a free block, the partial block is dropped and its
        computed tokens (at most ``block_size - 1``) are computed again by the next turn. An uncompacted policy state is plain KV (a next turn drops it: ``attach``) and
        goes with the block; a compacted layout is never cached (``LLMEngine._after_forward``),
        and if it were the history would lose its KV (``lose``). ``cut`` keeps the same rule
        for a cut history.

        How such a block gets there: a turn continuing from the history is lent its blocks
        (``lend``), the history's partial last block among them; the turn fills it with its own
        tokens and the prefix cache hashes it. When that turn is aborted (``detach``), undone
        (``rewind``) or restarted (``Sequence.restart``), the history keeps the hashed block
        with its own shorter length.

        Regression (review of session 32): the next turn then wrote its tokens' KV into the
        hashed block, and a request whose prompt started with the cancelled turn's tokens got
        a prefix hit on it and decoded other tokens than on an idle node (and the block, demoted,
        carried that KV to the host tier).
        """
        bs = self.kv_manager.block_size
        first = (sess.num_computed_tokens - sess.num_evicted_tokens) // bs
        if all(b.block_hash is None for b in sess.blocks[first:]):
            return
        if sess.compacted or sess.num_evicted_tokens:  # (not reached: compacted blocks are never cached)
            log.error("session %s: its compacted history holds a prefix-cached block; its KV is dropped",
                      sess.session_id)
            self.lose(sess)
            return
        self._drop_kv(sess)
        pool = self.kv_manager.pool
        if self.copy_block is not None and len(sess.blocks) == first + 1 and pool.can_allocate(1):
            # the history's partial block copied into a block of its own: the history keeps
            # all its KV, the hashed block stays matchable as cached (review s34 A L1: dropped,
            # its up to block_size - 1 tokens were computed again by the next turn, which under
            # a statistics-reading policy then decoded other tokens than had the cancelled turn
            # never run, unmarked)
            [copy] = pool.allocate(1)  # type: ignore[misc]  # (can_allocate: not None)
            self.copy_block(sess.blocks[first].block_id, copy.block_id)
            pool.free([sess.blocks[first]])
            sess.blocks[first] = copy
            return
        past, sess.blocks = sess.blocks[first:], sess.blocks[:first]
        pool.free(past[::-1])
        sess.num_computed_tokens = first * bs

    def _park(self, sess: Session) -> None:
        """Keep the history as it is now (``Session.previous``) until the next engine step
        (``drop_previous``) instead of freeing it, and clear it from ``sess``; a history without
        blocks (a full-cache turn took them over) has nothing to keep and is released."""
        if not sess.blocks:  # (an undo restores it without KV, with the loss it recorded)
            sess.previous_lost = sess.lost
            self._release(sess)
            return
        if sess.kept_for is not None:
            sess.kept_for.kept = sess.kept_for = None
        self._free_previous(sess)
        sess.previous = History(sess.token_ids, sess.num_computed_tokens, sess.num_evicted_tokens, sess.blocks,
                                sess.kv, sess.policy, sess.namespace)
        sess.previous_lost = None
        self._parked.add(sess.session_id)
        sess.blocks, sess.kv, sess.num_evicted_tokens = [], None, 0

    def _free_previous(self, sess: Session) -> None:
        """Free the history ``sess`` keeps for an undo, if any: an undo after this restores
        the history without KV, marked (``Session.previous_lost``)."""
        if sess.previous is not None:
            previous, sess.previous = sess.previous, None
            sess.previous_lost = LostState(previous.policy, previous.kv is not None and previous.kv.compacted)
            self._free_history(previous)

    def _free_history(self, history: History) -> None:
        if history.kv is not None:
            history.kv.reset()
        self.kv_manager.pool.free(list(reversed(history.blocks)))

    @staticmethod
    def _drop_kv(sess: Session) -> None:
        """Free the kept policy state: charge blocks and what it holds in lower tiers."""
        if sess.kv is not None:
            sess.kv.reset()
            sess.kv = None


class SessionKept:
    """The history KV a session keeps while its turn runs from it (``Sequence.kept``)."""

    def __init__(self, table: SessionTable, sess: Session) -> None:
        self.table, self.sess = table, sess

    def lend(self, seq: Sequence) -> bool:
        """``seq`` lost its KV: continue from the kept history again (``SessionTable.lend``)."""
        return self.table.lend(self.sess, seq)

    def num_blocks_beside(self, seq: Sequence) -> int:
        """Blocks the kept history holds that ``seq`` does not share: those its compaction
        copied on write, and the kept policy state's charge blocks."""
        shared = {id(b) for b in seq.block_table}
        charge = len(self.sess.kv.charge_blocks) if self.sess.kv is not None else 0
        return sum(1 for b in self.sess.blocks if id(b) not in shared) + charge

    def drop(self) -> None:
        """Free the kept history (the engine's last resort for blocks): a turn that loses its
        KV after this recomputes its whole prompt."""
        self.table.drop_history(self.sess)
