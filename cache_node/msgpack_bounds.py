"""msgpack decoding within bounds, for bytes from outside the process (the data plane's messages,
``services.data_plane.unpack``; spill group-file headers, ``cache_node.tiers.spill_format``).

msgpack's defaults let a container declare as many elements as the buffer has bytes, so one
byte (``0x80``, an empty map) becomes a 64-byte dict: a 32 MiB message of them built 2.3 GiB of
objects before any check looked at it (review 25a B, G). ``unpackb_within`` bounds each
container's length, each string and binary, refuses extension types, and counts the arrays and
maps and their elements over the whole message as each completes (msgpack calls the hooks
innermost first), so a message of many small containers stops at the first past the bound,
not after building them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack


@dataclass(frozen=True)
class UnpackBounds:
    """What one msgpack message may hold.

    Attributes:
        max_array_len, max_map_len: entries of one array / map.
        max_str_len, max_bin_len: bytes of one string / binary.
        max_containers: arrays and maps in the whole message.
        max_elements: their elements (a map's entry counts 2) in the whole message.
    """

    max_array_len: int
    max_map_len: int
    max_str_len: int
    max_bin_len: int
    max_containers: int
    max_elements: int


class _Budget:
    """The arrays and maps a message may still build, and their elements."""

    __slots__ = ("containers", "elements", "what")

    def __init__(self, bounds: UnpackBounds, what: str) -> None:
        self.containers, self.elements, self.what = bounds.max_containers, bounds.max_elements, what

    def array(self, value: list[Any]) -> list[Any]:
        self._spend(len(value))
        return value

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._spend(2 * len(value))
        return value

    def _spend(self, elements: int) -> None:
        self.containers -= 1
        self.elements -= elements
        if self.containers < 0 or self.elements < 0:
            raise ValueError(f"more arrays, maps or elements than {self.what} holds")


def unpackb_within(data: bytes, bounds: UnpackBounds, what: str = "a message of its kind") -> Any:
    """``data`` decoded (str as str, bin as bytes) within ``bounds``.

    Raises:
        ValueError: past a bound (before the objects past it are built; ``what`` names the kind
            of message in the text), or an extension type; msgpack's errors (``ValueError``
            subclasses, ``StackError``...) when it is not msgpack.
    """
    budget = _Budget(bounds, what)
    return msgpack.unpackb(
        data, raw=False, max_array_len=bounds.max_array_len, max_map_len=bounds.max_map_len,
        max_str_len=bounds.max_str_len, max_bin_len=bounds.max_bin_len, max_ext_len=0,
        list_hook=budget.array, object_hook=budget.map,
    )
