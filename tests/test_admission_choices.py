"""Admission of the choices of an ``n`` > 1 body (review 28b, open fault 2).

The gateway admits a body's choices one by one (``services.openai_api.choices``): choice 0
first, the others once choice 0's node has scheduled it, all with one routing key, so they
read the prompt's KV from choice 0's prefix cache. The scheduler hears of choice 0's blocks
only after the step that computes them, so it counted each later choice's whole prompt again.
Now a request of a tenant whose prompt (its block chain) is that of a request of the tenant in
flight on its node counts the prompt's full blocks as on the device (``_sibling_cached``).
Plain ``GlobalScheduler``, no Ray started.
"""

from __future__ import annotations

import pytest

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.global_scheduler import GlobalScheduler
from services.global_scheduler_admission import MAX_SIBLINGS, _admission_request
from services.node_request import NodeRequest
from tenants.model import TenantSpec


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _scheduler(tmp_path, nodes: tuple[str, ...] = ("n0",)) -> tuple[GlobalScheduler, dict[str, str], Clock]:
    clock = Clock()
    gs = GlobalScheduler(str(tmp_path), {n: 64 for n in nodes}, queue_limit=1000, scheduler="kvstrata", clock=clock)
    ids = {}
    for name in ("t", "u"):
        tenant, key = gs.register_tenant(TenantSpec(name, "interactive", ttft_slo_ms=1000.0))
        gs.authenticate(key)
        ids[name] = tenant.tenant_id
    for node in gs.nodes.values():
        node.prefill.set(1000.0)
        node.step_s.update(0.05)
    return gs, ids, clock


def _hashes(prompt_tokens: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i % 256, i // 256]) * 8 for i in range(prompt_tokens // 16)]


def _body(gs: GlobalScheduler, clock: Clock, tenant: str, tag: str, n: int, prompt_tokens: int,
          salt: int = 0) -> list[str]:
    """The admissions of one body's ``n`` choices, 2 ms apart, as the gateway sends them."""
    codes = []
    for c in range(n):
        clock.t += 0.002
        adm = gs.admit(tenant, f"{tag}-{c}", block_hashes=_hashes(prompt_tokens, salt),
                       prompt_tokens=prompt_tokens, routing_key=f"{tag}-key",
                       siblings=tuple(f"{tag}-{earlier}" for earlier in range(c)))
        codes.append(adm.code)
    return codes


def test_the_choices_of_a_body_count_its_prompt_once(tmp_path) -> None:
    """An interactive tenant (1 s TTFT target) on an idle 1,000 tokens/s node. Before, an
    ``n`` = 4 body of a 600-token prompt had its choice 1 refused (it waited on paper for
    choice 0's 600 tokens, then its own 600: 1.2 s), choice 0 was aborted, and every retry
    after the hint did the same: never served; at 300 tokens choice 3 was refused. Now each
    later choice waits for choice 0's prefill and its own last partial block: admitted."""
    gs, ids, clock = _scheduler(tmp_path)
    for prompt_tokens in (300, 600, 900):
        assert _body(gs, clock, ids["t"], f"b{prompt_tokens}", 4, prompt_tokens) == ["OK"] * 4, prompt_tokens
        node = gs.nodes["n0"]
        # choice 0's part holds the prompt; each later choice's only the tail past its full blocks
        tail = prompt_tokens % 16
        parts = node.backlog.parts[(0, ids["t"])]
        assert [round(parts[f"b{prompt_tokens}-{c}"]) for c in range(1, 4) if f"b{prompt_tokens}-{c}" in parts] \
            == [tail] * (3 if tail else 0)
        for c in range(4):
            gs.release(f"b{prompt_tokens}-{c}", None)
        assert not node.prompts and not node.prompt_of  # bounded by the requests in flight
        clock.t += 30.0


def test_only_the_same_tenants_same_prompt_in_flight_on_the_node_counts(tmp_path) -> None:
    """Another tenant's request with the same blocks, a different prompt of the tenant, and
    the same prompt once the first has ended each count their whole prompt; so does the same
    prompt on another node (its KV is not there)."""
    gs, ids, clock = _scheduler(tmp_path, nodes=("n0", "n1"))
    node = gs.nodes["n0"]
    gs.routing_keys.put(ids["t"], "k", "n0")
    gs.routing_keys.put(ids["u"], "k", "n0")
    assert gs.admit(ids["t"], "a", block_hashes=_hashes(160), prompt_tokens=160, routing_key="k").code == "OK"

    def part(tenant: str, rid: str, salt: int = 0, key: str = "k") -> float:
        assert gs.admit(ids[tenant], rid, block_hashes=_hashes(160, salt), prompt_tokens=160,
                        routing_key=key).code == "OK"
        node_id = gs.requests[rid][1]
        return gs.nodes[node_id].backlog.parts[(0, ids[tenant])].get(rid, 0.0) if node_id == "n0" else -1.0

    assert part("u", "other-tenant") == 160.0
    assert part("t", "other-prompt", salt=1) == 160.0
    assert part("t", "sibling") == 0.0  # 160 = 10 full blocks: nothing past them
    gs.routing_keys.put(ids["t"], "k1", "n1")
    assert part("t", "other-node", key="k1") == -1.0
    assert gs.nodes["n1"].backlog.parts[(0, ids["t"])]["other-node"] == 160.0
    for rid in ("a", "sibling"):
        gs.release(rid, None)
    clock.t += 0.001
    assert part("t", "after") == 160.0
    assert set(node.prompt_of) == {"other-tenant", "other-prompt", "after"}


def test_a_bodys_own_choices_are_no_work_ahead_on_a_slow_idle_node(tmp_path) -> None:
    """Session 40 new user: on an idle node whose meter runs slow (a 2-core host, where a short
    prompt's prefill is mostly per-step cost: here 20 tokens/s) a single 37-token request of an
    interactive tenant (1 s target) misses its target on its own and is admitted, nothing being
    ahead; but choice 1 of an ``n`` = 2 body saw choice 0's 37 tokens ahead (est. ~2.1 s) and
    was refused with a retry hint, and so was every retry: the body was never served. Now a
    body's own earlier choices are no work ahead (a wait cannot take them away), while another
    tenant's backlog still is: behind it a choice is refused, with a hint."""
    gs, ids, clock = _scheduler(tmp_path)
    gs.nodes["n0"].prefill.set(20.0)
    for attempt in range(3):  # every retry of the body, as the client sends it again
        assert _body(gs, clock, ids["t"], f"b{attempt}", 4, 37) == ["OK"] * 4, attempt
        for c in range(4):
            gs.release(f"b{attempt}-{c}", None)
        clock.t += 30.0
    # another tenant's prompt queued ahead on the node: real work ahead, refused with a hint
    assert gs.admit(ids["u"], "other", block_hashes=_hashes(400, salt=9), prompt_tokens=400,
                    routing_key="ok").code == "OK"
    clock.t += 0.002
    refused = gs.admit(ids["t"], "late-0", block_hashes=_hashes(37), prompt_tokens=37, routing_key="late-key")
    assert refused.code == "RESOURCE_EXHAUSTED" and refused.retry_after_s > 0


def test_separate_identical_requests_are_work_ahead_of_each_other(tmp_path) -> None:
    """Only the choices the gateway names as a body's own are no work ahead. Regression
    (eefd578's residue): any request of the tenant in flight on the node with the same prompt
    counted, so a second separate identical request sent at once, on the slow idle node of the
    test above, was admitted missing its target where it had been refused with a retry hint."""
    gs, ids, clock = _scheduler(tmp_path)
    gs.nodes["n0"].prefill.set(20.0)
    for rid in ("first", "second"):
        clock.t += 0.002
        adm = gs.admit(ids["t"], rid, block_hashes=_hashes(37), prompt_tokens=37, routing_key="k")
        codes = (adm.code, adm.retry_after_s > 0)
        assert codes == (("OK", False) if rid == "first" else ("RESOURCE_EXHAUSTED", True)), (rid, adm)


def test_named_siblings_count_only_when_the_tenants_same_prompt_in_flight(tmp_path) -> None:
    """The sibling ids are the gateway's word (untrusted): one that is another tenant's (the
    same blocks), another prompt's of the tenant, or not in flight counts for nothing, and one
    named twice counts once. Each case: the named request(s) admitted on a fast node, then the
    node slow (20 tokens/s) and a 37-token request naming them: were they its body's, nothing
    would be ahead of it and it would be admitted; it is refused with a hint."""
    cases = {  # case -> the requests in flight before it ((tenant, id, salt)), the ids it names
        "another tenant's": ([("u", "x", 0)], ("x",)),
        "another prompt's": ([("t", "x", 3)], ("x",)),
        "not in flight": ([("u", "y", 5)], ("x",)),
        "named twice": ([("t", "x", 0), ("u", "y", 5)], ("x", "x")),
    }
    for case, (in_flight, siblings) in cases.items():
        gs, ids, clock = _scheduler(tmp_path / case.replace(" ", "_").replace("'", ""))
        for tenant, rid, salt in in_flight:
            clock.t += 0.002
            assert gs.admit(ids[tenant], rid, block_hashes=_hashes(37, salt), prompt_tokens=37,
                            routing_key="k").code == "OK", case
        gs.nodes["n0"].prefill.set(20.0)
        clock.t += 0.002
        adm = gs.admit(ids["t"], "probe", block_hashes=_hashes(37), prompt_tokens=37, routing_key="k",
                       siblings=siblings)
        assert (adm.code, adm.retry_after_s > 0) == ("RESOURCE_EXHAUSTED", True), (case, adm)


def test_an_admissions_sibling_ids_are_checked_as_untrusted() -> None:
    """The data plane's admission message: ``sibs`` is absent (none) or a list of at most
    ``MAX_SIBLINGS`` request ids of 1 to ``MAX_ID_CHARS`` characters; anything else is a
    malformed admission (TypeError / ValueError), never handed to ``admit``."""
    req = data_plane.request_to_wire(NodeRequest(request_id="t/1_r#a", tenant="t", cache_namespace="",
                                                 sampling=SamplingParams(), token_ids=(1, 2)))
    msg = {"id": 1, "req": req, "sub": "tcp://127.0.0.1:1", "hashes": []}
    assert _admission_request(msg)[5] == ()
    assert _admission_request({**msg, "sibs": ["t/0_r#b"]})[5] == ("t/0_r#b",)
    assert len(_admission_request({**msg, "sibs": ["x"] * MAX_SIBLINGS})[5]) == MAX_SIBLINGS
    for bad, error in (("t/0_r#b", TypeError), ([b"t/0_r#b"], TypeError), ([1], TypeError), ({"a": 1}, TypeError),
                       ([""], ValueError), (["x" * (data_plane.MAX_ID_CHARS + 1)], ValueError),
                       (["x"] * (MAX_SIBLINGS + 1), ValueError)):
        with pytest.raises(error, match="sibs"):
            _admission_request({**msg, "sibs": bad})
