"""The global scheduler's admission checks: what refuses a request and what admission knows of
the nodes. An admission's outcome (``Admission``, a refusal's reason one of ``REJECT_REASONS``);
a request of a tenant the store does not hold (``_unknown_tenant``); a full queue, past which
only a tenant under its fair share of the places is admitted (``_over_queue``); under the
``kvstrata`` scheduler, a TTFT estimate over the node's prefill backlog that the request's class
does not allow (``_slo_admission``, on ``NodeLoad`` and the prompt's cached tokens per tier).
``AdmissionChecks`` is a part of ``services.global_scheduler.GlobalScheduler``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cache_node.scheduling import SLO_CLASS_RANK
from cache_node.scheduling.admission import (
    CachedTokens,
    Ewma,
    FluidBacklog,
    NodePace,
    SpeedMeter,
    decide,
    estimate_ttft_s,
)
from cache_node.scheduling.base import DEFAULT_SHARE
from services.block_index import PrefixTiers
from services.data_plane_wire import MAX_RETRY_AFTER_S
from tenants.model import TenantSpec

if TYPE_CHECKING:
    from tenants.store import TenantStore

PREFILL_TOKENS_PER_S_RANGE = (1.0, 1e7)
"""Prefill speeds (tokens/s) taken from a node's ``finished`` event (``NodeLoad.take_speeds``):
a positive one outside is taken at the nearer end (a tiny model on a fast GPU can prefill past
ten million tokens a second: review 25c); one that is no positive real number is ignored and
counted."""

MAX_STEP_S = 60.0
"""Longest step (s) taken from a node's ``finished`` event; a longer one is taken as this, and
one that is no positive real number is ignored and counted."""


def prompt_key(tenant_id: str, block_hashes: list[bytes]) -> tuple[str, bytes] | None:
    """A prompt as ``NodeLoad.prompts`` keeps it: its tenant and a digest of its block chain
    (the last hash chains every block before it; digested: 16 bytes whatever the gateway
    sent). None without a full block."""
    if not block_hashes:
        return None
    chain = len(block_hashes).to_bytes(8, "little") + block_hashes[-1]
    return tenant_id, hashlib.blake2b(chain, digest_size=16).digest()


def _clamped(value: Any, low: float, high: float) -> float | None:
    """``value`` put into [low, high] when it is a positive real number (no bool), else None."""
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        return None
    return min(max(float(value), low), high)


@dataclass
class NodeLoad:
    """A node as admission sees it: in-flight requests, prefill backlog, measured speeds, and
    how much slower than its meter its prefill queue runs (``pace``)."""

    node_id: str
    capacity: int
    in_flight: set[str] = field(default_factory=set)
    urgent: set[str] = field(default_factory=set)  # in-flight requests of interactive tenants
    backlog: FluidBacklog = field(default_factory=FluidBacklog)
    prefill: SpeedMeter = field(default_factory=SpeedMeter)
    step_s: Ewma = field(default_factory=lambda: Ewma(prior=0.05))
    pace: NodePace = field(default_factory=NodePace)
    # the prompts of its admitted requests in flight (``prompt_key``: tenant and block chain),
    # how many of them each; and each such request's key
    prompts: Counter[tuple[str, bytes]] = field(default_factory=Counter)
    prompt_of: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    def hold_prompt(self, request_id: str, key: tuple[str, bytes] | None) -> None:
        """Request ``request_id`` (admitted here) has the prompt ``key`` (None: no full block)."""
        if key is not None and request_id:
            self.prompts[key] += 1
            self.prompt_of[request_id] = key

    def drop_prompt(self, request_id: str) -> None:
        key = self.prompt_of.pop(request_id, None)
        if key is not None:
            self.prompts[key] -= 1
            if self.prompts[key] <= 0:
                del self.prompts[key]

    def prefill_tokens_per_s(self, now_s: float) -> float:
        """The speed its prefill queue runs at now: the meter's, slowed by ``pace`` at its load
        (its requests in flight)."""
        return self.prefill.tokens_per_s / self.pace.factor(now_s, len(self.in_flight))

    def take_speeds(self, usage: dict[str, Any]) -> list[str]:
        """Take the node's measured ``prefill_tokens_per_s`` and ``step_s`` (its ``finished``
        event, as the gateway forwards it) into ``prefill`` and ``step_s``; returns the names of
        those present and ignored: no positive real number. One past its range is taken at
        the nearer end (``PREFILL_TOKENS_PER_S_RANGE``, ``MAX_STEP_S``).

        Regression (review 25a E): they were taken as they came (the gateway checks only that
        they are finite and >= 0); a node reporting 1e-300 tokens/s made every later TTFT
        estimate on it ~1e305 ms, refusals whose ``retry_after_s`` (8e302) the gateway refused as
        a malformed reply (UNAVAILABLE, no hint), and its backlog never drained again."""
        ignored = []
        speed = _clamped(usage.get("prefill_tokens_per_s"), *PREFILL_TOKENS_PER_S_RANGE)
        if speed is not None:
            self.prefill.set(speed)
        else:
            ignored.append("prefill_tokens_per_s")
        if "step_s" in usage:
            step_s = _clamped(usage["step_s"], 0.0, MAX_STEP_S)
            if step_s is not None:
                self.step_s.update(step_s)
            else:
                ignored.append("step_s")
        return ignored


@dataclass(frozen=True)
class Admission:
    """Outcome of ``admit``: a node to run on, or a rejection with a gRPC status name.

    ``spill_blocks``: leading prompt blocks (past those on the node's device and host tiers)
    that the index places in the spill tier; > 0 means the node should prefetch them.
    ``reason``: why it was refused, one of ``REJECT_REASONS`` ("" when admitted).
    """

    node_id: str = ""
    code: str = "OK"
    message: str = ""
    retry_after_s: float = 0.0
    spill_blocks: int = 0
    reason: str = ""
    continues_session: bool = False  # routed to the node holding the request's session

    def __post_init__(self) -> None:
        """``retry_after_s`` within [0, ``MAX_RETRY_AFTER_S``], what the gateway takes
        (``data_plane.admission_reply``): a hint past it (a deep backlog on a slow node) says
        "a day", and is never a reply the scheduler's own gateway refuses as malformed
        (regression, review 25a E: 8e302 s made an admission UNAVAILABLE with no hint)."""
        retry = self.retry_after_s
        if not 0.0 <= retry <= MAX_RETRY_AFTER_S:  # NaN too: no wait is known to end it
            object.__setattr__(self, "retry_after_s", 0.0 if retry < 0 else MAX_RETRY_AFTER_S)


REJECT_REASONS = ("no_healthy_node", "session_of_another_tenant", "queue_full", "ttft_estimate", "gateway_gone",
                  "node_not_reading", "too_many_sessions", "session_node_down", "session_lost", "tenant_deleted",
                  "unknown_tenant", "key_revoked", "released_early", "tenant_changed")
"""``Admission.reason`` of a refusal (the ``reason`` label of ``kvstrata:admission_rejections``)."""


class AdmissionChecks:
    """Admission checks of ``GlobalScheduler`` (which provides these attributes)."""

    nodes: dict[str, NodeLoad]
    requests: dict[str, tuple[str, str, str, str]]
    deleted_tenants: OrderedDict[str, None]
    scheduler: str
    block_size: int
    queue_limit: int
    clock: Any

    if TYPE_CHECKING:
        store: TenantStore

        def knows_tenant(self, tenant_id: str) -> bool: ...

        def _spec_by_id(self, tenant_id: str) -> TenantSpec | None: ...

    def _unknown_tenant(self, tenant_id: str) -> Admission | None:
        """The refusal of a request whose ``tenant_id`` is no tenant of the store
        (``knows_tenant``): UNAUTHENTICATED, "tenant_deleted" for a deleted tenant's,
        "unknown_tenant" for any other. None for a tenant's request. Nothing is counted per
        tenant for such an id (its ``usage`` would grow with every id a caller makes up)."""
        if self.knows_tenant(tenant_id):
            return None
        if tenant_id in self.deleted_tenants:
            return Admission(code="UNAUTHENTICATED", reason="tenant_deleted",
                             message="this request's tenant was deleted")
        return Admission(code="UNAUTHENTICATED", reason="unknown_tenant",
                         message="this request's tenant is not registered with the scheduler")

    def _removed_key(self, key_id: str) -> Admission | None:
        """The refusal of a request authenticated with a key removed since (rotated away, or
        its tenant deleted: ``TenantStore.key_removed``): UNAUTHENTICATED, "key_revoked".
        None otherwise, or for no key id ("").

        Regression (session 32's open list): a gateway's key cache passed a key rotated away
        through another gateway (or the CLI through this scheduler) for up to its TTL (10 s),
        and the requests it authenticated were admitted and ran, billed to the tenant that had
        revoked that key."""
        if not key_id or not self.store.key_removed(key_id):
            return None
        return Admission(code="UNAUTHENTICATED", reason="key_revoked",
                         message="this request's API key was rotated away or removed")

    def _cached_tokens(self, prefix: PrefixTiers, prompt_tokens: int) -> CachedTokens:
        """Prompt tokens per tier from a prefix in blocks, capped at ``prompt_tokens``
        (device first, then host, then spill)."""
        left = prompt_tokens
        tokens = []
        for blocks in (prefix.device, prefix.host, prefix.spill):
            n = min(left, blocks * self.block_size)
            tokens.append(n)
            left -= n
        return CachedTokens(device=tokens[0], host=tokens[1], spill=tokens[2], miss=left)

    def _sibling_cached(self, node: NodeLoad, key: tuple[str, bytes] | None, num_blocks: int,
                        cached: CachedTokens) -> CachedTokens:
        """``cached``, or with every full block of the prompt on the device when a request of
        the same tenant with the same blocks (``prompt_key``) is in flight on ``node``: a
        later choice of an ``n`` > 1 body, which the gateway starts once choice 0 has been
        scheduled there and which reads the prompt's KV from choice 0's prefix cache. Its
        prompt's full blocks are counted once, in choice 0's part of the backlog.

        Regression: each choice's whole prompt was counted again (the index hears of choice
        0's blocks only after the step that computes them); choice 1 of a 600-token prompt
        waited on paper for choice 0's 600 tokens, refused on an idle 1,000 tokens/s node
        with a 1 s interactive target, and so was every retry of the body (choice 0 started
        and aborted each time): an interactive ``n`` = 4 body of a 300-token prompt or more was
        never served."""
        if key is None or not node.prompts.get(key):
            return cached
        total = cached.device + cached.host + cached.spill + cached.miss
        device = min(total, num_blocks * self.block_size)
        return CachedTokens(device=device, miss=total - device)

    def _slo_admission(self, tenant_id: str, node_id: str, cached: CachedTokens,
                       request_id: str = "", siblings: list[str] | None = None) -> Admission | None:
        """Queue the request's uncached tokens on the node's backlog (under its tenant and
        weight, as ``request_id``'s part: ``release`` takes out what is left of it), or reject
        it (kvstrata only) when its estimated TTFT misses what its class allows. None =
        admitted.

        ``siblings``: the earlier choices of its ``n`` > 1 body in flight on the node with this
        request's prompt, as its gateway named them (``GlobalScheduler._own_body``). Their parts of the
        backlog stay in the estimate but are no work *ahead* for ``decide``: no wait takes them
        away, as every retry of the body starts its choice 0 again. Regression (session 40 new
        user): on an idle node whose meter ran slow (a 2-core host: short prompts' prefill is
        mostly per-step cost) an interactive tenant's single request was admitted as the one
        missing its target with nothing ahead, but choice 1 of any ``n`` >= 2 body saw choice 0's
        prompt ahead and was refused with a ``Retry-After`` that never helped: 429 "estimated
        TTFT 2409 ms exceeds the interactive limit 800 ms" for a 31-token chat at ``n`` = 2, at
        every retry, while choice 0 alone answered in 230 ms."""
        spec = self._spec_by_id(tenant_id)
        node = self.nodes[node_id]
        rank = SLO_CLASS_RANK[spec.slo_class.value] if spec else 1
        weight = spec.weight if spec else DEFAULT_SHARE.weight
        now = self.clock()
        speed = node.prefill_tokens_per_s(now)  # regression (review 28b): the meter's, however slow
        # the node really served (busy decoding, or slower than it says): the backlog drained on
        # paper while its requests waited, and admission under-estimated every TTFT
        node.backlog.drain(now, speed)
        if self.scheduler == "kvstrata" and spec is not None:
            # the node's order: better classes, then its class interleaved across tenants by
            # weight (VTC): its own tenant's backlog and the others' weighted share meanwhile
            ahead = node.backlog.ahead(rank, tenant_id, cached.miss, weight)
            # an interactive prefill runs in a step of its own (isolates_urgent_prefill): it
            # waits for the step in progress, half of one on average, not for a whole one
            wait_s = node.step_s.value * (0.5 if rank == 0 else 1.0)
            est_ms = 1000.0 * estimate_ttft_s(ahead, cached, speed, wait_s)
            own_body = sum(node.backlog.part(rid) for rid in siblings or ())
            decision = decide(spec.slo_class.value, spec.ttft_slo_ms, est_ms, 1000.0 * max(0.0, ahead - own_body) / speed)
            own = None if decision.admit else node.pace.probe(tenant_id, now, len(node.in_flight))
            if own is not None:
                # regression (review 29i F3): a tenant with no pace of its own was refused on the
                # other tenants' for as long as theirs stayed high, and a refused request is no
                # sample: an interactive tenant got 0 of 59 admitted in 300 s while another
                # tenant's first tokens came 8 times late for its own reasons. Now one request
                # per PACE_PROBE_S is estimated on its own few samples (the meter's speed without
                # any), and admitted if that meets its target: its first token is its sample
                probe_speed = node.prefill.tokens_per_s / own
                probe_ms = 1000.0 * estimate_ttft_s(ahead, cached, probe_speed, wait_s)
                probe = decide(spec.slo_class.value, spec.ttft_slo_ms, probe_ms,
                               1000.0 * max(0.0, ahead - own_body) / probe_speed)
                if probe.admit:
                    node.pace.probed(tenant_id, request_id, now)
                    decision, est_ms, speed = probe, probe_ms, probe_speed
            if not decision.admit:
                return Admission(code="RESOURCE_EXHAUSTED", message=decision.reason,
                                 retry_after_s=decision.retry_after_s, reason="ttft_estimate")
            # what its first token will say of the node's pace (``release``): its prefill at
            # the meter's speed (its own uncached tokens' part apart: a structured request's grammar
            # compiles while the queue ahead drains), and the rest of its estimate (promotion, step wait)
            prefill_s = (ahead + cached.miss) / node.prefill.tokens_per_s
            rest_s = est_ms / 1000.0 - (ahead + cached.miss) / speed
            node.pace.admitted(request_id, tenant_id, prefill_s, rest_s, len(node.in_flight), est_ms,
                               cached.miss / node.prefill.tokens_per_s)
        node.backlog.add(rank, tenant_id, cached.miss, weight, request_id)
        return None

    def _over_queue(self, tenant_id: str, queued: int) -> bool:
        """Whether a request of ``tenant_id`` finds the queue full: ``queue_limit`` requests
        wait and the tenant holds at least its fair share of all places (running capacity +
        ``queue_limit``, evenly among the tenants with requests in flight, itself included),
        or twice ``queue_limit`` wait whoever asks. Regression: the limit was global, so one
        tenant's burst got every other tenant RESOURCE_EXHAUSTED until it drained."""
        if queued < self.queue_limit:
            return False
        if queued >= 2 * self.queue_limit:
            return True
        held = self.in_flight_by_tenant()
        tenants = len(held) + (tenant_id not in held)
        places = sum(n.capacity for n in self.nodes.values()) + self.queue_limit
        return held[tenant_id] >= places / tenants

    def in_flight_by_tenant(self) -> Counter[str]:
        """Requests admitted and not yet released, per tenant id."""
        return Counter(tenant_id for tenant_id, *_ in self.requests.values())

    def _queued(self) -> int:
        """Requests waiting beyond the nodes' running capacity (what ``queue_limit`` bounds)."""
        return sum(max(0, len(n.in_flight) - n.capacity) for n in self.nodes.values())
