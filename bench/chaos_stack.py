"""The local kvstrata stack bench.chaos and tests/test_chaos.py break: tiny model, real actors.

- ``tiny_checkpoint``: a random two-layer Llama saved with SmolLM2's tokenizer and chat template
  (so chat prompts, sessions and sentence-aware policies work), built once and cached beside the
  converted models (``cache_node.model_loader.cache_dir``);
- ``chaos_config`` / ``ChaosStack``: the services on the current Ray cluster with that model,
  a small pool, no spill RAM (blocks demoted to the spill node land on its disk) and the gRPC
  stubs with the admin key;
- ``actor_pid`` / ``kill9``: the worker process of a named actor and a real ``SIGKILL`` of it;
- ``node_leaks``: every node's block accounting once idle (integrity checked).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import ray

from kvstrata.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    tenant_pb2,
    tenant_pb2_grpc,
)
from services.config import NodeConfig, ServiceConfig
from services.grpc_messages import client_channel_options
from services.launcher import Services, start_services, stop_services
from services.ray_auth import init_local_cluster

TINY_NAME = "kvstrata-chaos-tiny-llama"
BLOCK_SIZE = 16
POOL_BLOCKS = 96


def tiny_checkpoint() -> Path:
    """A random tiny Llama checkpoint (2 layers, hidden 64, SmolLM2's 49,152-token vocabulary
    and tokenizer), created on first use in ``cache_dir()``; returns its directory."""
    from cache_node.model_files import cache_dir, ensure_checkpoint

    return ensure_checkpoint(cache_dir() / TINY_NAME, _build_tiny)  # built once, under a lock


def _build_tiny(target: Path) -> Path:
    """Build the tiny checkpoint and save it as ``target`` (absent; ``save_checkpoint``)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from cache_node.model_files import save_checkpoint
    from cache_node.model_loader import _GGUF_FILE, _gguf_dir

    tok = AutoTokenizer.from_pretrained(str(_gguf_dir()), gguf_file=_GGUF_FILE)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return save_checkpoint(target, model, tok)


def block_bytes() -> int:
    """Bytes of one KV block of the tiny model (float32; layers, K and V, block, kv heads, dim)."""
    return 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def chaos_config(state_dir: str, resource_prefix: str = "", **overrides: Any) -> ServiceConfig:
    """Two cache nodes (``POOL_BLOCKS`` blocks each, no host tier) and one spill node with disk
    only, on the ``<prefix>cache_node`` / ``<prefix>spill_node`` resources."""
    node = NodeConfig(
        model_path=str(tiny_checkpoint()), block_size=BLOCK_SIZE, kv_pool_bytes=POOL_BLOCKS * block_bytes(),
        max_num_batched_tokens=256, max_num_seqs=16, host_bytes=0, prefetch_wait_s=0.5, torch_threads=1,
    )
    cfg: dict[str, Any] = {
        "num_cache_nodes": 2, "node": node, "gateway_port": 0, "http_port": 0, "state_dir": state_dir, "queue_limit": 64,
        "cache_node_resource": f"{resource_prefix}cache_node", "spill_node_resource": f"{resource_prefix}spill_node",
        "spill_ram_bytes": 0, "spill_disk_bytes": 64 << 20, "start_timeout_s": 300.0, "scheduler": "fcfs",
    }
    cfg.update(overrides)
    return ServiceConfig(**cfg)


@dataclass
class ChaosStack:
    """A running deployment, its gRPC channel and two registered tenants' keys."""

    services: Services
    channel: grpc.Channel
    keys: dict[str, str] = field(default_factory=dict)

    @classmethod
    def start(cls, config: ServiceConfig, tenants: tuple[str, ...] = ("chaos-a", "chaos-b")) -> ChaosStack:
        services = start_services(config)
        stack = cls(services, grpc.insecure_channel(services.address, options=client_channel_options()))
        for name in tenants:
            stack.keys[name] = stack.register(name)
        return stack

    def stop(self) -> None:
        self.channel.close()
        stop_services(self.services)

    @property
    def address(self) -> str:
        return self.services.address

    @property
    def inference(self) -> inference_pb2_grpc.InferenceServiceStub:
        return inference_pb2_grpc.InferenceServiceStub(self.channel)

    @property
    def tenants(self) -> tenant_pb2_grpc.TenantServiceStub:
        return tenant_pb2_grpc.TenantServiceStub(self.channel)

    @property
    def admin(self) -> admin_pb2_grpc.AdminServiceStub:
        return admin_pb2_grpc.AdminServiceStub(self.channel)

    def admin_md(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.services.admin_key}"),)

    def md(self, tenant: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.keys[tenant]}"),)

    def register(self, name: str) -> str:
        spec = tenant_pb2.TenantSpec(name=name)
        resp = self.tenants.RegisterTenant(tenant_pb2.RegisterTenantRequest(spec=spec), metadata=self.admin_md(), timeout=30)
        return resp.api_key

    def reconnect(self) -> None:
        self.channel.close()
        self.channel = grpc.insecure_channel(self.services.address, options=client_channel_options())

    def stats(self, check_integrity: bool = True, timeout_s: float = 30.0) -> admin_pb2.StatsResponse:
        return self.admin.Stats(admin_pb2.StatsRequest(check_integrity=check_integrity),
                                metadata=self.admin_md(), timeout=timeout_s)

    def usage(self, tenant: str) -> tenant_pb2.Usage:
        return self.tenants.GetUsage(tenant_pb2.GetUsageRequest(name=tenant), metadata=self.admin_md(),
                                     timeout=30).usage

    def tenant_names(self) -> list[str]:
        resp = self.tenants.ListTenants(tenant_pb2.ListTenantsRequest(), metadata=self.admin_md(), timeout=30)
        return sorted(t.spec.name for t in resp.tenants)


def actor_pid(handle: Any) -> int | None:
    """PID of the actor's live worker process (None while it is not ALIVE), read from the GCS
    actor table (the state API needs the dashboard, which the stack runs without)."""
    from ray._private import state

    info = state.actors(actor_id=handle._actor_id.hex())
    return int(info["Pid"]) if info and info["State"] == "ALIVE" and info.get("Pid") else None


def kill9(handle: Any) -> int:
    """``SIGKILL`` the actor's worker process (a real crash: no cleanup runs); returns its PID.

    Raises:
        RuntimeError: the actor has no live process.
    """
    pid = actor_pid(handle)
    if pid is None:
        raise RuntimeError("the actor has no live worker process to kill")
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_new_pid(handle: Any, old_pid: int, timeout_s: float) -> int | None:
    """The PID of the actor's restarted worker once it is ALIVE again (None after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = actor_pid(handle)
        if pid is not None and pid != old_pid:
            return pid
        time.sleep(0.25)
    return None


def node_leaks(stats: admin_pb2.StatsResponse) -> dict[str, dict[str, Any]]:
    """Per node: blocks not free once idle (``num_blocks - free - cached``), whether the pool's
    integrity check passed, and the requests still running or waiting."""
    return {
        n.node_id: {
            "num_blocks": n.num_blocks, "leaked_blocks": n.num_blocks - n.free_blocks - n.cached_blocks,
            "used_blocks": n.used_blocks, "running": n.running, "waiting": n.waiting,
            "integrity_ok": n.integrity_ok, "integrity_error": n.integrity_error,
        }
        for n in stats.nodes
    }


def wait_idle(stack: ChaosStack, timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """``node_leaks`` once no node runs or queues anything (or at ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = node_leaks(stack.stats())
        idle = all(v["running"] == v["waiting"] == 0 for v in leaks.values())
        if idle or time.monotonic() > deadline:
            return leaks
        time.sleep(0.25)


def gen_request(text: str, max_tokens: int, session_id: str = "", policy: str = "",
                request_id: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        chat=inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(role="user", content=text)]),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        session_id=session_id, policy=policy, request_id=request_id,
    )


def ray_local(resources: dict[str, float], namespace: str = "kvstrata") -> None:
    """A one-node local Ray cluster offering ``resources`` (2 CPUs), unless Ray is already up."""
    if not ray.is_initialized():
        init_local_cluster(num_cpus=2, resources=resources, namespace=namespace, include_dashboard=False,
                           log_to_driver=False)  # token-authenticated: its ports face the network


def stack_on_cluster(cluster: Any, prefix: str, state_dir: str) -> Iterator[ChaosStack]:
    """A ``ChaosStack`` on a ``ray.cluster_utils.Cluster`` that the driver is connected to: one
    more Ray node offering ``<prefix>cache_node`` x2 and ``<prefix>spill_node`` (so the stack
    never competes with other deployments on the cluster), in namespace ``kvstrata-<prefix>``;
    stopped and the node removed afterwards."""
    node = cluster.add_node(num_cpus=0, resources={f"{prefix}cache_node": 2, f"{prefix}spill_node": 1})
    cluster.wait_for_nodes()
    stack = ChaosStack.start(chaos_config(state_dir, prefix, namespace=f"kvstrata-{prefix.strip('_')}"))
    try:
        yield stack
    finally:
        stack.stop()
        cluster.remove_node(node)
