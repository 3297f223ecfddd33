"""A gateway stopped for good leaves no served-address record in the cluster's GCS; another
deployment's gateway keeps its own.

Since 10d420a each gateway keeps the addresses it served in Ray's GCS key-value store
(``services.gateway_served.ServedRecord``, key ``gateway_served/<actor id>``) so that a restart
serves again there. Regression (s38): no path deleted it, so every gateway a cluster ever ran
left its record for the cluster's life. Now ``stop_services``, a failed start's ``_kill_placed``
and ``kvstrata down`` (``_kill_services``) delete the stopped gateway's record by its actor id.

Real parts: Ray's GCS store, a gateway actor (``tests.ray_actors.ServedGateway``) saving its
record under its own id as ``RayGateway`` does, the launcher's and the CLI's stop paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
from ray.experimental import internal_kv

from cli.lifecycle import _kill_services
from services.config import ServiceConfig
from services.gateway_served import NAMESPACE, GcsKeyValues, ServedRecord
from services.launcher import GATEWAY_NAME, SCHEDULER_NAME, Services, _kill_placed, stop_services
from tests.ray_actors import NameHolder, ServedGateway

OTHER_ID = "f" * 32
"""Another deployment's gateway on the same cluster (an actor id no actor here has)."""


@pytest.fixture
def other_record(ray_cluster) -> Iterator[bytes]:  # type: ignore[no-untyped-def]
    """Another deployment's gateway record, saved for the test and removed after it."""
    asyncio.run(ServedRecord(OTHER_ID).save({"grpc": "10.0.0.9:50051"}))
    yield ServedRecord(OTHER_ID).key
    _delete(ServedRecord(OTHER_ID).key)


def _delete(key: bytes) -> None:
    internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def _serving_gateway(namespace: str) -> tuple[Any, bytes]:
    gateway = ServedGateway.options(name=GATEWAY_NAME, namespace=namespace).remote()
    gateway_id = ray.get(gateway.serve.remote("127.0.0.1:50051"), timeout=60)
    assert gateway_id == gateway._actor_id.hex()
    key = ServedRecord(gateway_id).key
    assert GcsKeyValues().get(key) is not None
    return gateway, key


def _stopped(namespace: str, stop: Callable[[Any], None], other: bytes) -> None:
    gateway, key = _serving_gateway(namespace)
    try:
        stop(gateway)
        assert GcsKeyValues().get(key) is None, "the stopped gateway's record is left"
        assert GcsKeyValues().get(other) is not None, "another deployment's record was deleted"
    finally:
        with contextlib.suppress(Exception):
            ray.kill(gateway)
        _delete(key)


def test_stop_services_deletes_the_gateways_record(other_record: bytes) -> None:
    namespace = "kvstrata-served-stop"
    scheduler = NameHolder.options(name=SCHEDULER_NAME, namespace=namespace).remote()  # no flush_durable
    _stopped(namespace, lambda gateway: stop_services(
        Services(scheduler, {}, gateway, 0, "", ServiceConfig(namespace=namespace))), other_record)


def test_a_failed_start_deletes_the_gateways_record(other_record: bytes) -> None:
    namespace = "kvstrata-served-failed-start"
    _stopped(namespace, lambda gateway: _kill_placed({GATEWAY_NAME: gateway}, namespace), other_record)


def test_down_deletes_the_gateways_record(other_record: bytes) -> None:
    namespace = "kvstrata-served-down"
    _stopped(namespace, lambda gateway: _kill_services(namespace, ""), other_record)


def test_records_of_gateways_ray_lists_dead_are_pruned_and_no_others(other_record: bytes) -> None:
    """Regression (s39): a gateway that died for good on its own (killed, no restart left: no
    stop path ran) kept its record for the cluster's life. ``prune_dead`` (every gateway start
    runs it) deletes it, keeps a live gateway's and the unknown other deployment's."""
    from services.gateway_served import actor_state, prune_dead

    dead, dead_key = _serving_gateway("kvstrata-served-dead")
    live, live_key = _serving_gateway("kvstrata-served-live")
    try:
        ray.kill(dead, no_restart=True)
        deadline = time.monotonic() + 30
        while actor_state(dead._actor_id.hex()) != "DEAD":
            assert time.monotonic() < deadline, "Ray did not list the killed gateway dead"
            time.sleep(0.05)
        assert GcsKeyValues().get(dead_key) is not None  # what was left before
        assert dead._actor_id.hex() in prune_dead()
        assert GcsKeyValues().get(dead_key) is None
        assert GcsKeyValues().get(live_key) is not None and GcsKeyValues().get(other_record) is not None
    finally:
        with contextlib.suppress(Exception):
            ray.kill(live)
        _delete(dead_key)
        _delete(live_key)
