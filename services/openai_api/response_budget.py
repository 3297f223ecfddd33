"""The bytes of whole (non-streamed) responses handed to their connections and not yet written
out, per tenant (``ResponseBudget``), and the response that holds its bytes in it until its
connection has written them (``HeldResponse``).

A whole response is built once its request has ended: its stream no longer counts against
``max_streams_per_tenant`` and no idle-reader deadline watches it. Its bytes then sit in the
connection's transport until the client reads them; the connection's minimum read rate
(``ConnectionLimits.min_send_rate_bytes_per_s``, ``send_stall_timeout_s``) ends a client that
takes them too slowly or not at all, and this budget
bounds what one tenant's clients hold meanwhile, as ``context.BodyBudget`` bounds its request
bodies.

Regression (review 27a, F3): nothing bounded it; a tenant whose clients never read held each
response (up to ~19 MB with log probabilities) for as long as they kept their connections open,
256 connections per address.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import grpc
from starlette.responses import Response

from services.openai_api.context import CallAborted
from services.openai_api.logprobs import OFF_LOOP_LOGPROBS
from services.openai_api.scope_hooks import written

OFF_LOOP_CHARS = 1 << 17
"""A whole response holding more characters of text than this (its choices' texts together,
an echoed prompt's included: 128 KiB to 1.5 MiB of JSON, a character taking 1 to 12 bytes) is
built on a worker thread, as one past ``OFF_LOOP_LOGPROBS`` is (``Held.off_loop``)."""


class Held(NamedTuple):
    """What a whole response's body will hold, known before it is built (``OpenAIEdge.render``
    decides from it where to build it, and refuses it first when its tenant's
    ``ResponseBudget`` has no room for its least size).

    ``values``: its log probabilities (``/tokenize``'s: its token ids and texts), each choice's
    together. ``chars``: the characters of its text, each choice's together, an echoed
    prompt's included (``echo`` makes a body of ``n`` copies of a prompt of up to
    ``MAX_PROMPT_CHARS`` characters, or of a token prompt's decoded text).

    Regression (review s33 F1): only log probabilities were counted, so an echo without them
    counted 0 and its body (n 16 x 131,072 tokens' text: 25 MB) was built on the event loop
    every tenant's calls share (187 ms), before its budget was looked at."""

    values: int = 0
    chars: int = 0

    def off_loop(self) -> bool:
        """Built on a worker thread: past ``OFF_LOOP_LOGPROBS`` values or ``OFF_LOOP_CHARS``
        characters, or past the two's shares together (``values / OFF_LOOP_LOGPROBS +
        chars / OFF_LOOP_CHARS > 1``)."""
        return self.values * OFF_LOOP_CHARS + self.chars * OFF_LOOP_LOGPROBS > OFF_LOOP_LOGPROBS * OFF_LOOP_CHARS

    def least_bytes(self) -> int:
        """The fewest bytes its JSON can take: one a character and one a value."""
        return self.values + self.chars

    @staticmethod
    def total(parts: list[Held]) -> Held:
        """``parts`` (one a choice) together."""
        return Held(sum(p.values for p in parts), sum(p.chars for p in parts))


class ResponseBudget:
    """Whole-response bytes held by tenant: at most ``per_tenant_bytes`` each, except that a
    tenant holding none may always hold one response, however large (``MAX_WHOLE_LOGPROBS``
    bounds it before it runs)."""

    def __init__(self, per_tenant_bytes: int, retry_after_ms: int) -> None:
        if per_tenant_bytes <= 0 or retry_after_ms <= 0:
            raise ValueError(f"ResponseBudget needs per_tenant_bytes and retry_after_ms > 0, got "
                             f"{per_tenant_bytes!r}, {retry_after_ms!r}")
        self.per_tenant_bytes, self.retry_after_ms = per_tenant_bytes, retry_after_ms
        self.per_tenant: Counter[str] = Counter()

    def check_room(self, tenant_id: str) -> None:
        """Before a non-streamed request runs: refused while its tenant's held bytes reach the
        budget (no work is done for a response that could not be held).

        Raises:
            CallAborted: RESOURCE_EXHAUSTED (429) with ``retry_after_ms``.
        """
        if self.per_tenant[tenant_id] >= self.per_tenant_bytes:
            raise self._refusal(self.per_tenant[tenant_id])

    def check_fits(self, tenant_id: str, nbytes: int) -> None:
        """Before a response of at least ``nbytes`` is built: refused as ``hold`` would refuse
        it (no body is built that could not be held).

        Raises:
            CallAborted: RESOURCE_EXHAUSTED (429) with ``retry_after_ms`` when the tenant holds
                some already and ``nbytes`` more would pass ``per_tenant_bytes``.
        """
        held = self.per_tenant[tenant_id]
        if held and held + nbytes > self.per_tenant_bytes:
            raise self._refusal(held)

    def hold(self, tenant_id: str, nbytes: int) -> ResponseHold:
        """Hold ``nbytes`` of a built response of ``tenant_id``'s.

        Raises:
            CallAborted: RESOURCE_EXHAUSTED (429) with ``retry_after_ms`` when the tenant holds
                some already and ``nbytes`` more would pass ``per_tenant_bytes``.
        """
        self.check_fits(tenant_id, nbytes)
        held = self.per_tenant[tenant_id]
        self.per_tenant[tenant_id] = held + nbytes
        return ResponseHold(self, tenant_id, nbytes)

    def _refusal(self, held: int) -> CallAborted:
        return CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"response: this tenant's whole responses not yet read by their clients hold "
                           f"{held} bytes at this gateway (at most {self.per_tenant_bytes}); read them, or "
                           f"stream, and retry later", self.retry_after_ms)

    def check_integrity(self) -> None:
        """No tenant's count is negative (a hold released twice, or never taken)."""
        if any(n < 0 for n in self.per_tenant.values()):
            raise AssertionError(f"response budget out of balance: {dict(self.per_tenant)}")


class ResponseHold:
    """One response's bytes in a ``ResponseBudget``."""

    def __init__(self, budget: ResponseBudget, tenant_id: str, nbytes: int) -> None:
        self.budget, self.tenant_id, self.held = budget, tenant_id, nbytes

    def release(self) -> None:
        """Give back what it holds (again: nothing)."""
        if self.held:
            counts = self.budget.per_tenant
            counts[self.tenant_id] -= self.held
            if counts[self.tenant_id] <= 0:
                del counts[self.tenant_id]
            self.held = 0


class HeldResponse(Response):
    """A built JSON body that keeps its ``hold`` until its connection has written it out or is
    gone (``scope_hooks.written``), however sending it ends."""

    media_type = "application/json"

    def __init__(self, body: bytes, hold: ResponseHold) -> None:
        super().__init__(body)
        self.hold = hold

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
            await written(scope)
        finally:
            self.hold.release()
