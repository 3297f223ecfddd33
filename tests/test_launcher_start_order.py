"""``start_services``' order: the gateway actor is created right after the cache nodes, so its
process start and imports (~9 s of a loaded 2-core host) overlap their model load (~15 s), and
a start that fails kills every actor it created, the early gateway included.

Real Ray (the session cluster), real actors: the cache nodes ask for a resource no Ray node
offers, so they stay pending and the start fails at ``start_timeout_s``."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray

from services.config import ServiceConfig
from services.launcher import start_services
from tests.ray_actors import NameHolder


def _names(namespace: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace}


def test_the_gateway_is_created_while_the_nodes_load_and_a_failed_start_kills_everything(
    ray_cluster, tmp_path: Path
) -> None:
    """Regression: the gateway was created only once every node had loaded its model (its ~9 s
    start after theirs, one after the other), and a failed start left the scheduler and the
    nodes placed so far behind (a library caller's; ``kvstrata up`` killed them by name)."""
    namespace = "kvstrata-start-order-test"
    config = ServiceConfig(namespace=namespace, state_dir=str(tmp_path / "state"), num_cache_nodes=1, num_spill_nodes=0,
                           cache_node_resource="kvstrata_test_no_such_resource", start_timeout_s=3,
                           gateway_port=0, http_port=0, metrics_enabled=False)
    failed: list[BaseException] = []

    def start() -> None:
        try:
            start_services(config)
        except Exception as exc:  # noqa: BLE001 - the failure under test, checked below
            failed.append(exc)

    starting = threading.Thread(target=start)
    starting.start()
    seen: set[str] = set()
    while starting.is_alive():  # what the start has placed while its cache node is pending
        seen |= _names(namespace)
        time.sleep(0.05)
    starting.join()

    assert seen == {"global_scheduler", "cache_node_0", "gateway"}, seen  # no gateway before
    assert len(failed) == 1 and "cache node actors were not up within 3 s" in str(failed[0]), failed
    deadline = time.monotonic() + 10
    while _names(namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _names(namespace) == set()  # {'global_scheduler', 'cache_node_0'} left before


@pytest.mark.parametrize(("taken", "cache_nodes", "spill_nodes"), [("cache_node_1", 2, 0), ("spill_node_1", 1, 2)])
def test_a_start_failing_on_its_second_node_kills_the_first(
    ray_cluster, tmp_path: Path, taken: str, cache_nodes: int, spill_nodes: int
) -> None:
    """Regression (review s37 r4 F2): the cache nodes (and the spill nodes) were added to what a
    failed start kills only once all of them were created; when creating the second raised
    (its name taken, Ctrl-C), the first, detached, was left holding its name for good, and
    every later start failed on it."""
    namespace = f"kvstrata-partial-create-test-{taken}"
    other = NameHolder.options(name=taken, namespace=namespace, lifetime="detached").remote()
    ray.get(other.ping.remote())
    config = ServiceConfig(namespace=namespace, state_dir=str(tmp_path / "state"), num_cache_nodes=cache_nodes,
                           num_spill_nodes=spill_nodes, cache_node_resource="kvstrata_test_no_such_resource",
                           spill_node_resource="kvstrata_test_no_such_resource", start_timeout_s=3, detached=True,
                           gateway_port=0, http_port=0, metrics_enabled=False)
    try:
        with pytest.raises(ValueError, match=f"{taken} .* is already taken"):
            start_services(config)
        deadline = time.monotonic() + 10
        while _names(namespace) != {taken} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _names(namespace) == {taken}  # {taken, 'cache_node_0' or 'spill_node_0'} before
        assert ray.get(other.ping.remote()) == "other"
    finally:
        ray.kill(other)
