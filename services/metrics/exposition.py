"""``/metrics`` bodies rendered at most once per interval and shared by every scraper.

``CachedExposition`` renders a registry with prometheus_client's own encoders
(``exposition.choose_encoder``: the 0.0.4 text format, or OpenMetrics when the scraper's
``Accept`` asks for it, as ``make_wsgi_app`` negotiates) and keeps the bytes, and their gzip
(``exposition.gzip_accepted``) once a scraper asks for it, for ``interval_s``. One render
runs at a time (a lock); every scrape in that interval gets the same cached bytes.

The formats are a fixed set (``KNOWN_CONTENT_TYPES``: the text format 0.0.4 and 1.0.0 and
OpenMetrics 1.0.0, each escaping): an ``Accept`` naming another version gets the 0.0.4 text
format, so no header a client picks adds a render. A ``name[]`` filter is not applied (the
whole registry is served), for the same reason.

Regression (security review 23d, I): every connection rendered the whole registry anew, on
the actor's own threads, 16 at once, so a client scraping in a loop held the GIL the
gateway's serving loop (or a cache node's step thread) needed: a loop turn of 1 ms took
48 ms on average, 0.3 s at worst, with 100 tenants' series.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import (
    CONTENT_TYPE_PLAIN_0_0_4,
    choose_encoder,
    generate_latest,
    gzip_accepted,
)
from prometheus_client.openmetrics import exposition as openmetrics

DEFAULT_RENDER_INTERVAL_S = 1.0
"""How long a rendered body is served before the next scrape renders again."""

_ESCAPINGS = (openmetrics.UNDERSCORES, openmetrics.DOTS, openmetrics.VALUES, openmetrics.ALLOWUTF8)
KNOWN_CONTENT_TYPES = frozenset(
    [CONTENT_TYPE_PLAIN_0_0_4, choose_encoder("application/openmetrics-text")[1]]
    + [choose_encoder(f"{kind}; version=1.0.0; escaping={escaping}")[1]
       for kind in ("text/plain", "application/openmetrics-text") for escaping in _ESCAPINGS])
"""The content types served (each one cached body): what ``choose_encoder`` picks for the
text format 0.0.4 and 1.0.0 and OpenMetrics 1.0.0, with each escaping."""


class _Body:
    """One render: its bytes, when it was made, and their gzip once asked for."""

    def __init__(self, raw: bytes, rendered_s: float) -> None:
        self.raw, self.rendered_s = raw, rendered_s
        self._gzipped: bytes | None = None

    def gzipped(self) -> bytes:
        if self._gzipped is None:
            self._gzipped = gzip.compress(self.raw)
        return self._gzipped


class CachedExposition:
    """``registry``'s exposition, rendered at most once per ``interval_s`` per content type.

    ``renders`` counts the renders made (one per content type and interval at most).

    Raises:
        ValueError: ``interval_s`` is not positive.
    """

    def __init__(self, registry: CollectorRegistry, interval_s: float = DEFAULT_RENDER_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s > 0:
            raise ValueError(f"metrics render interval must be > 0 s, got {interval_s}")
        self.registry, self.interval_s, self.clock = registry, interval_s, clock
        self.renders = 0
        self._lock = threading.Lock()
        self._bodies: dict[str, _Body] = {}  # content type -> its latest render

    def reply(self, accept: str | None, accept_encoding: str | None) -> tuple[list[tuple[str, str]], bytes]:
        """The headers and body of a ``GET /metrics`` with these ``Accept`` and
        ``Accept-Encoding`` headers (None: absent), from the cache while it is fresh."""
        encoder, content_type = choose_encoder(accept or "")
        if content_type not in KNOWN_CONTENT_TYPES:
            encoder, content_type = generate_latest, CONTENT_TYPE_PLAIN_0_0_4
        headers = [("Content-Type", content_type)]
        with self._lock:
            body = self._bodies.get(content_type)
            if body is None or self.clock() - body.rendered_s >= self.interval_s:
                body = self._bodies[content_type] = _Body(encoder(self.registry), self.clock())
                self.renders += 1
            if not gzip_accepted(accept_encoding or ""):
                return headers, body.raw
            return headers + [("Content-Encoding", "gzip")], body.gzipped()

    def wsgi_app(self) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
        """A WSGI app serving ``reply`` to a GET; other methods and ``/favicon.ico`` as
        prometheus_client's ``make_wsgi_app`` answers them (they render nothing)."""
        renders_nothing = make_wsgi_app(CollectorRegistry())

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ["REQUEST_METHOD"] != "GET" or environ.get("PATH_INFO") == "/favicon.ico":
                return renders_nothing(environ, start_response)
            headers, body = self.reply(environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING"))
            start_response("200 OK", headers)
            return [body]

        return app
