"""A real two-node Ray cluster with the kvstrata services and a real gRPC channel."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import ray
from ray.cluster_utils import Cluster

from kvstrata.v1 import (
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tenant_pb2,
    tenant_pb2_grpc,
)
from services.config import NodeConfig, ServiceConfig
from services.launcher import Services, start_services, stop_services


@dataclass
class Stack:
    cluster: Cluster
    services: Services
    channel: grpc.Channel
    config: ServiceConfig

    @property
    def tenants(self) -> tenant_pb2_grpc.TenantServiceStub:
        return tenant_pb2_grpc.TenantServiceStub(self.channel)

    @property
    def inference(self) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(self.channel)

    @property
    def admin(self) -> admin_pb2_grpc.AdminServiceStub:
        return admin_pb2_grpc.AdminServiceStub(self.channel)

    def admin_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.services.admin_key}"),)

    def restart(self) -> None:
        """Stop every service actor and start them again from the same state dir."""
        self.channel.close()
        stop_services(self.services)
        self.services = start_services(self.config)
        self.channel = grpc.insecure_channel(self.services.address)

    def register(self, name: str, namespace: str = "", **spec: object) -> str:
        resp = self.tenants.RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name=name, cache_namespace=namespace, **spec)),
            metadata=self.admin_md(),
        )
        return resp.api_key


def start_cluster() -> Iterator[Cluster]:
    """Head (cache_node 1, spill_node 8) + worker (cache_node 1), connected as the driver.

    Without Ray's dashboard UI: no test reads it (``ray._private.state`` asks the GCS), and its
    nine module processes (``ray-dashboard-*Head``; the dashboard's head process runs either
    way) cost CPU at the start and ~0.7-0.9 s of CPU every 30 s after, on the 2-core test
    machine (bench.chaos_stack's ``ray_local`` starts none either)."""
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": {"cache_node": 1, "spill_node": 8}, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, resources={"cache_node": 1})
    ray.init(address=cluster.address, namespace="kvstrata-test", log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def start_stack(cluster: Cluster, state_dir: str | None = None, **overrides: object) -> Iterator[Stack]:
    cfg = ServiceConfig(
        num_cache_nodes=2,
        node=NodeConfig(kv_pool_bytes=64 << 20, max_num_seqs=16, torch_threads=1, fault_injection=True),
        gateway_port=0, http_port=0,
        state_dir=state_dir or tempfile.mkdtemp(prefix="kvstrata-state-"),
        # mechanics tests: no estimate-based early rejection; /metrics renders on each scrape
        # (a test reads a counter right after the requests it counts)
        **{"scheduler": "fcfs", "metrics_render_interval_s": 0.001, **overrides},
    )
    services = start_services(cfg)
    channel = grpc.insecure_channel(services.address)
    stack = Stack(cluster, services, channel, cfg)
    try:
        yield stack
    finally:
        stack.channel.close()
        stop_services(stack.services)


def chat(text: str, max_tokens: int = 8, session_id: str = "", **kw: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=text)]),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens),
        session_id=session_id,
        **kw,
    )


def collect(stream) -> dict:
    out = {"text": "", "tokens": [], "started": None, "finished": None}
    for msg in stream:
        kind = msg.WhichOneof("event")
        if kind == "delta":
            out["text"] += msg.delta.text
            out["tokens"].extend(msg.delta.token_ids)
        else:
            out[kind] = getattr(msg, kind)
    return out
