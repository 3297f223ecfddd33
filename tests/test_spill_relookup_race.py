"""Two threads looking the same dead spill node up again at once both get its new handle.

``RaySpillClient._node`` is called from the cache node's step thread and from its other
threads (a flush, the gateway's calls): both may find node ``i`` due for a look-up
(``RELOOKUP_S`` passed) and both resolve its name. Regression: the second to finish did
``del self._died[i]`` after the first had; its KeyError was taken by the look-up's own
``except`` for "no live actor yet", which marked the node just found alive as dead again (a
look-up more after ``RELOOKUP_S``, and the KeyError hidden).
"""

from __future__ import annotations

import threading
import time

import pytest

from services.spill_client import RELOOKUP_S, RaySpillClient

pytestmark = pytest.mark.timeout(30)


class BarrierRef:
    """A spill node's ``ActorRef`` stand-in whose look-up returns ``handle`` once ``parties``
    look-ups are under way together: the interleaving two threads may have, made certain (a
    real ``ActorRef`` needs a Ray cluster and gives no control of the timing)."""

    def __init__(self, handle: object, parties: int) -> None:
        self.handle = handle
        self.barrier = threading.Barrier(parties, timeout=10)

    def resolve(self) -> object:
        self.barrier.wait()
        return self.handle


def test_two_threads_looking_the_same_node_up_again_both_get_its_handle() -> None:
    new_handle = object()
    ref = BarrierRef(new_handle, parties=2)
    client = RaySpillClient([None], (1, 2, 4, 1, 8), "float32", refs=[ref])  # type: ignore[list-item]
    client._died[0] = time.monotonic() - RELOOKUP_S - 1  # due for a look-up
    got: list[object] = []
    errors: list[BaseException] = []

    def look_up() -> None:
        try:
            got.append(client._node(0))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=look_up) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert errors == []
    assert got == [new_handle, new_handle]
    assert client.nodes == [new_handle]
    assert 0 not in client._died, "the node found alive was marked dead again"
