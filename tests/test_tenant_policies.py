"""A tenant's allowed KV policies (issue 18 fault 9: any tenant could choose any policy).

``TenantSpec.allowed_policies`` (empty = all) is set by the admin; a request naming a policy
outside it is PERMISSION_DENIED at the gateway (real gRPC, tests.gateway_harness).
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from kvstrata.v1 import inference_pb2, inference_pb2_grpc, tenant_pb2, tenant_pb2_grpc
from services import convert
from tenants.model import MAX_ALLOWED_POLICIES, TenantSpec
from tenants.store import TenantStore
from tests.gateway_harness import NODE_INFO, serve


def test_allows_policy_by_name_or_exact_spec() -> None:
    """issue 18 fault 9: an entry names a policy (all its specs) or one exact spec."""
    spec = TenantSpec("ann", allowed_policies=["snapkv", "h2o-256"])
    assert [spec.allows_policy(p) for p in ("", "snapkv", "snapkv-0.25", "h2o-256", "h2o", "h2o-128",
                                            "quant-bits_8")] == [True, True, True, True, False, False, False]
    assert TenantSpec("bob").allows_policy("quant-bits_8") is True  # empty = every policy


def test_allowed_policies_validated() -> None:
    """issue 18 fault 9: malformed lists and a default policy outside the list are refused."""
    with pytest.raises(ValueError, match="^policy 'h2o' is not in allowed_policies"):
        TenantSpec("ann", policy="h2o", allowed_policies=["snapkv"])
    with pytest.raises(ValueError, match="^allowed_policies must match"):
        TenantSpec("ann", allowed_policies=["bad name"])
    with pytest.raises(ValueError, match="^allowed_policies must be a list"):
        TenantSpec("ann", allowed_policies="snapkv")
    with pytest.raises(ValueError, match=f"^allowed_policies holds {MAX_ALLOWED_POLICIES + 1} names"):
        TenantSpec("ann", allowed_policies=[f"p{i}" for i in range(MAX_ALLOWED_POLICIES + 1)])


def test_allowed_policies_persist_and_convert(tmp_path: Path) -> None:
    """issue 18 fault 9: the field survives the store and the wire; old rows mean 'all'."""
    spec = TenantSpec("ann", policy="snapkv-0.5", allowed_policies=["snapkv", "h2o"])
    assert convert.tenant_spec_from_pb(convert.tenant_spec_to_pb(spec)) == spec
    store = TenantStore(tmp_path / "t.sqlite")
    store.register(spec)
    store.close()
    assert TenantStore(tmp_path / "t.sqlite").get("ann").spec == spec
    old_row = {k: v for k, v in spec.to_dict().items() if k != "allowed_policies"} | {"policy": ""}
    assert TenantSpec.from_dict(json.loads(json.dumps(old_row))).allowed_policies == ()


def test_request_outside_allowed_policies_is_permission_denied(tmp_path: Path) -> None:
    """issue 18 fault 9: Generate naming a policy outside the tenant's list: PERMISSION_DENIED."""
    too_long = NODE_INFO["max_model_len"] + 1  # an allowed request fails later, on its length
    with serve(tmp_path) as gw, grpc.insecure_channel(gw.address) as ch:
        reg = tenant_pb2_grpc.TenantServiceStub(ch).RegisterTenant(
            tenant_pb2.RegisterTenantRequest(spec=tenant_pb2.TenantSpec(name="ann", allowed_policies=["snapkv"])),
            metadata=(("authorization", f"Bearer {gw.admin_key}"),))
        assert list(reg.tenant.spec.allowed_policies) == ["snapkv"]
        stub = inference_pb2_grpc.InferenceServiceStub(ch)

        def generate(policy: str) -> tuple[grpc.StatusCode, str]:
            req = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=[1, 2, 3]), policy=policy,
                                                sampling=inference_pb2.SamplingParams(max_tokens=too_long))
            try:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {reg.api_key}"),), timeout=10))
            except grpc.RpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""

        denied = generate("h2o-0.5")
        allowed = generate("snapkv-0.5")

    assert denied == (grpc.StatusCode.PERMISSION_DENIED,
                      "KV policy 'h2o-0.5' is not allowed for this tenant; allowed: snapkv")
    assert allowed[0] == grpc.StatusCode.INVALID_ARGUMENT and allowed[1].startswith(
        f"This model's maximum context length is {too_long - 1} tokens. However, you requested {3 + too_long} tokens "
        f"(3 in the prompt, {too_long} in the completion).")


def test_cli_tenant_add_allow_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """issue 18 fault 9: `kvstrata tenant add --allow-policy` sets the list."""
    from typer.testing import CliRunner

    from cli import main as cli

    with serve(tmp_path) as gw:
        monkeypatch.setenv("KVSTRATA_ADMIN_KEY", gw.admin_key)
        result = CliRunner().invoke(cli.app, ["tenant", "add", "ann", "--allow-policy", "snapkv",
                                              "--allow-policy", "h2o-256", "--gateway", gw.address])
        assert result.exit_code == 0, result.output
        assert gw.scheduler.store.get("ann").spec.allowed_policies == ("snapkv", "h2o-256")
