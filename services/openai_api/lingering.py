"""What a closed HTTP connection still holds in the kernel: ``Lingering``, the unsent tail of a
connection that uvicorn (or the app) closed while its kernel send queue held bytes its client
had not taken, kept counted and under the minimum read rate until the client has taken them.

A response small enough for the kernel's send buffer (up to ~4 MiB, ``net.ipv4.tcp_wmem``) is
all handed to the kernel at once; the transport then holds nothing, is never held up, and
uvicorn's close (its keep-alive timeout, ``Connection: close``) closes the socket at once. The
kernel keeps the orphaned socket and its queue for as long as its client trickles, which no
bound of the gateway saw: the connection left ``ConnectionGuard``'s counts (caps, per-network
counts, ``http_connections_open``) and the minimum read rate stopped. A ``Lingering`` keeps a
duplicate of the socket's descriptor so the kernel socket stays this process's, half-closed
(FIN queued after the data, as the close would have), counted in its guard until the queue is
empty (then closed) or its client falls ``send_stall_timeout_s`` behind the minimum rate (then
reset, ``SO_LINGER`` 0: the kernel drops the queue; counted ``send_stalled``). A newcomer that
needs its slot resets it too (shed); a graceful stop or restart of the server releases it
(closed normally: the kernel goes on delivering to its client, bounded by its orphan limits).

Linux only (``SIOCOUTQ``). HTTPS connections are not kept so: asyncio's SSL layer closes the
TCP socket before the protocol hears of it (``connection_lost`` is scheduled after), so their
kernel tail stays as before (uncounted; bounded by the kernel's orphan limits).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import sys
from collections.abc import Callable

if sys.platform == "linux":
    import fcntl
    import termios

    SIOCOUTQ: int | None = termios.TIOCOUTQ  # (the same request number on a TCP socket)
else:
    SIOCOUTQ = None

POLL_FIRST_S = 0.02
"""The first look at a lingering queue; each later look waits twice as long, up to ``POLL_MAX_S``."""
POLL_MAX_S = 1.0


def kernel_unsent(fd: int) -> int:
    """Bytes in the kernel send queue of socket ``fd`` not yet acknowledged by its peer
    (Linux's ``SIOCOUTQ``); 0 when it cannot be read (another platform, a closed socket)."""
    if SIOCOUTQ is None or fd < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(fd, SIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class Lingering:
    """The kernel-held tail of a closed connection (module docstring).

    Args:
        sock: a duplicate of the connection's socket (this object closes it).
        unsent: bytes in its send queue now.
        behind_s: how far its client was behind ``min_rate`` already (``Guarded._behind_s``).
        grace_s: ``send_stall_timeout_s``; min_rate: ``min_send_rate_bytes_per_s``.
        done: called once when it ends, with ``"send_stalled"`` when it was reset for its
            client's rate, else None (its queue emptied, or ``end`` or ``release`` was called).
    """

    def __init__(self, sock: socket.socket, unsent: int, behind_s: float, grace_s: float, min_rate: float,
                 done: Callable[[str | None], None]) -> None:
        self.sock, self.unsent, self.behind_s = sock, unsent, behind_s
        self.grace_s, self.min_rate, self.done = grace_s, min_rate, done
        self.loop = asyncio.get_running_loop()
        self.since, self.wait_s = self.loop.time(), POLL_FIRST_S
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)  # FIN after the queued data, as the close would have sent
        self.timer: asyncio.TimerHandle | None = self.loop.call_later(self._next_wait_s(), self._look)

    def _next_wait_s(self) -> float:
        """Until the next look: the poll's backoff, or sooner when the client, taking nothing
        more, would reach ``grace_s`` behind."""
        return max(0.001, min(self.wait_s, self.grace_s - self.behind_s))

    def _look(self) -> None:
        """Account what the client took since the last look; close when all was taken, reset
        when it fell ``grace_s`` behind, else look again. A look that came late (the loop
        stalled) counts no more than the wait it was set for."""
        self.timer = None
        now, unsent = self.loop.time(), kernel_unsent(self.sock.fileno())
        held_s = min(now - self.since, self._next_wait_s())
        self.behind_s = max(0.0, self.behind_s + held_s - max(0, self.unsent - unsent) / self.min_rate)
        self.since, self.unsent = now, unsent
        if not unsent:
            self._end(None)
        elif self.behind_s >= self.grace_s - 0.001:
            self._end("send_stalled")
        else:
            self.wait_s = min(self.wait_s * 2, POLL_MAX_S)
            self.timer = self.loop.call_later(self._next_wait_s(), self._look)

    def end(self) -> None:
        """Reset it now (``SO_LINGER`` 0: the kernel drops its queue): its slot is shed for a
        newcomer."""
        self._end(None, reset=True)

    def release(self) -> None:
        """Stop counting it now and close the duplicate descriptor normally (the server stops
        or restarts gracefully): the kernel keeps the orphaned socket and delivers its queue,
        then the FIN, to a client that reads, bounded by the kernel's orphan limits
        (``net.ipv4.tcp_max_orphans``, ``tcp_orphan_retries``), as before lingering was kept.

        Regression (review of c1f4966): every gateway stop and in-process restart reset these
        (``end``), so a well-behaved client mid-download got ``ConnectionResetError`` (174,080
        of 1,048,576 bytes for one reading ~256 KiB/s) where before it got the whole response."""
        self._end(None)

    def _end(self, reason: str | None, reset: bool = False) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.sock.fileno() < 0:
            return
        if reason is not None or reset:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        self.done(reason)
