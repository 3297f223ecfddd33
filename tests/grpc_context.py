"""A stand-in for the gRPC servicer context ``InferenceServicer.generate`` is called with."""

from __future__ import annotations

from typing import Any

import grpc


class Refused(Exception):
    """``context.abort``: the call was refused with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class GrpcContext:
    """What ``InferenceServicer.generate`` calls on a gRPC servicer context: the ``key`` as
    its bearer token (None: no metadata); ``abort`` raises ``Refused``."""

    def __init__(self, key: str | None = None) -> None:
        self.key = key

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.key is None else (("authorization", f"Bearer {self.key}"),)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5"

    async def send_initial_metadata(self, _metadata: Any) -> None:
        return None

    def set_trailing_metadata(self, _metadata: Any) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, message: str = "") -> None:
        raise Refused(code, message)
