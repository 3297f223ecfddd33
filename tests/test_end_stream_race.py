"""A stream ended by the node (deleted tenant, drained node, closed session) aborts its request
whatever the order the threads run in (review 31: the consumer saw its last event and dropped
the stream before the node's abort found it; the request ran on to its ``max_tokens``)."""

from __future__ import annotations

import threading
import time
from typing import Any

from services.cache_node import CacheNode
from services.config import NodeConfig
from tests.test_deleted_tenant_cache import drain, prompt, request


def test_a_deleted_tenants_request_stops_even_when_its_consumer_sees_the_end_first() -> None:
    node = CacheNode("t", NodeConfig(kv_pool_bytes=128 << 20), num_threads=1)
    try:
        ended: list[dict[str, Any]] = []
        running = threading.Thread(target=lambda: ended.append(
            drain(node, request("b1", "bob", "tenant:bob", prompt(1), 1800))))
        running.start()
        deadline = time.monotonic() + 60
        while "b1" not in node.engine.requests or not node.engine.requests["b1"].output_token_ids:
            assert running.is_alive() and time.monotonic() < deadline, ended
            time.sleep(0.01)
        abort = node.abort

        def late_abort(request_id: str) -> bool:  # the node's thread is slower than the consumer's
            time.sleep(1.0)
            return abort(request_id)

        node.abort = late_abort  # type: ignore[method-assign]
        node.end_tenant("bob")
        running.join(30)
        assert ended and ended[0]["code"] == "ABORTED"
        deadline = time.monotonic() + 15
        while "b1" in node.engine.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        seq = node.engine.requests.get("b1")
        assert seq is None, f"the deleted tenant's request still runs: {seq.status}, {len(seq.output_token_ids)} tokens"
        deadline = time.monotonic() + 15
        while node._purges and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not node._purges  # its namespace was dropped once its request ended
        node.engine.check_integrity()
    finally:
        node.shutdown()
