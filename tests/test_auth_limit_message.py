"""A refusal of API-key checks (or a tenant's own key rotations) over their limit says the wait
its ``retry-after-ms`` trailer and the HTTP API's ``Retry-After`` header say (review 25b N1:
"retry in 0 s" beside ``Retry-After: 1``: the message rounded the wait down, the header up)."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from services.auth_limits import CheckLimits
from services.openai_api.context import CallAborted
from tenants.errors import TooManyRotationsError


class _Refused(Exception):
    pass


class _Ctx:
    def __init__(self) -> None:
        self.trailer: dict[str, str] = {}
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailer = dict(metadata)

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _Refused


@pytest.mark.parametrize("wait_s", [0.001, 0.3, 0.5, 0.999, 1.2, 2.0, 9.7])
def test_the_over_limit_message_says_the_headers_wait(wait_s: float) -> None:
    ctx = _Ctx()
    with pytest.raises(_Refused):
        asyncio.run(CheckLimits._abort_over_limit(ctx, wait_s))
    retry_after_ms = int(ctx.trailer["retry-after-ms"])
    header = CallAborted(ctx.code, ctx.details, retry_after_ms).response().headers["retry-after"]
    said = re.fullmatch(r"too many failed API-key checks from this address; retry in (\d+) s", ctx.details)
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED and said, ctx.details
    assert said.group(1) == header, (ctx.details, header)


@pytest.mark.parametrize("wait_s", [0.0, 0.3, 0.999, 1.2, 2.0])
def test_the_key_rotation_limits_message_says_the_headers_wait(wait_s: float) -> None:
    """The same for a tenant's own key rotations over their limit (``TooManyRotationsError``,
    whose ``retry_after_ms`` the gateway sends as the trailer)."""
    exc = TooManyRotationsError("bob", wait_s)
    header = CallAborted(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), exc.retry_after_ms).response().headers
    assert str(exc) == f"tenant 'bob' rotated its own key too often; retry in {header['retry-after']} s"
