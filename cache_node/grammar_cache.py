"""Compiled grammars kept by (kind, spec), bounded by entries and bytes, and specs that failed.

``GrammarCache`` is a least-recently-used map of compiled grammars: at most ``max_entries``,
and at most ``max_bytes`` counting each grammar's ``memory_size_bytes`` plus its key's spec
text (a grammar larger than the whole budget is used by its requests but not kept). A spec
whose compilation failed (it does not compile, ran past the time limit, or the compiler
process died on it) is remembered with its message for ``failed_ttl_s`` (at most
``max_entries`` of them, oldest out first), so the same spec sent again is refused at once
instead of costing the compiler another full time limit. Not thread-safe: ``Grammars`` holds
its lock around every call.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

Key = tuple[str, str]


def grammar_bytes(key: Key, compiled: Any) -> int:
    """What a kept grammar costs: xgrammar's ``memory_size_bytes`` and its key's text."""
    return int(compiled.memory_size_bytes) + len(key[0]) + len(key[1])


class GrammarCache:
    """Args:
        max_entries: most compiled grammars kept (and most failed specs remembered).
        max_bytes: most bytes of compiled grammars kept (``grammar_bytes``).
        failed_ttl_s: how long a failed spec is refused without compiling.
    """

    def __init__(self, max_entries: int, max_bytes: int, failed_ttl_s: float) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.failed_ttl_s = failed_ttl_s
        self._kept: OrderedDict[Key, tuple[Any, int]] = OrderedDict()  # key -> (grammar, bytes)
        self._failed: OrderedDict[Key, tuple[float, str]] = OrderedDict()  # key -> (until, message)
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: Key) -> Any | None:
        """The kept grammar of ``key`` (now the most recently used), or None."""
        entry = self._kept.get(key)
        if entry is None:
            return None
        self._kept.move_to_end(key)
        return entry[0]

    def put(self, key: Key, compiled: Any) -> bool:
        """Keep ``compiled``, evicting the least recently used past either bound. False when
        it alone is over ``max_bytes`` (not kept)."""
        size = grammar_bytes(key, compiled)
        if size > self.max_bytes:
            return False
        self._drop(key)
        self._kept[key] = (compiled, size)
        self.num_bytes += size
        while len(self._kept) > self.max_entries or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._kept)))
        return True

    def _drop(self, key: Key) -> None:
        entry = self._kept.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry[1]

    def failed(self, key: Key, now: float) -> str | None:
        """The message of ``key``'s failure within the last ``failed_ttl_s``, else None."""
        entry = self._failed.get(key)
        if entry is None:
            return None
        if entry[0] <= now:
            del self._failed[key]
            return None
        return entry[1]

    def put_failed(self, key: Key, message: str, now: float) -> None:
        """Remember that ``key`` failed with ``message`` until ``now + failed_ttl_s``."""
        if self.failed_ttl_s <= 0:
            return
        self._failed.pop(key, None)
        self._failed[key] = (now + self.failed_ttl_s, message)
        while len(self._failed) > self.max_entries:
            self._failed.popitem(last=False)

    def check_integrity(self) -> None:
        """``num_bytes`` is the sum of the kept entries' bytes, within both bounds."""
        total = sum(size for _, size in self._kept.values())
        if total != self.num_bytes:
            raise AssertionError(f"grammar cache counts {self.num_bytes} bytes, its entries hold {total}")
        if total > self.max_bytes or len(self._kept) > self.max_entries:
            raise AssertionError(f"grammar cache past its bounds: {len(self._kept)} entries, {total} bytes")
