"""What an admission costs the scheduler's one loop is bounded per message, not paid in Python
steps per token (review s34 B F3): the token-id checks are C-speed scans, the scheduler leaves
the token ids to the node, and nothing the checks refused before passes now.

Cost is counted in Python function calls (``cProfile``), not in seconds: this host is shared.
"""

from __future__ import annotations

import asyncio
import cProfile
import hashlib
import pstats
import tempfile
from typing import Any

import pytest
import zmq

from cache_node.sampling_params import SamplingParams
from services import data_plane
from services.data_plane_wire import MAX_TOKEN_ID
from services.global_scheduler_admission import GlobalSchedulerService
from services.node_request import NodeRequest
from tests.known_tenants import know_tenants

TOKENS = tuple(range(1, 131_073))  # a token prompt's most (MAX_PROMPT_TOKEN_IDS)


def wire(token_ids: Any = TOKENS, **sampling: Any) -> dict[str, Any]:
    req = NodeRequest(request_id="t/r#a", tenant="t", cache_namespace="ns", token_ids=(1,),
                      sampling=SamplingParams(max_tokens=1))
    fields = data_plane.request_to_wire(req)
    fields["token_ids"] = list(token_ids)
    fields["sampling"] = {**fields["sampling"], **sampling}
    return fields


def python_calls(fn: Any, *args: Any, **kwargs: Any) -> tuple[int, Any]:
    profile = cProfile.Profile()
    result = profile.runcall(fn, *args, **kwargs)
    return pstats.Stats(profile).total_calls, result  # type: ignore[attr-defined]


def test_token_ids_are_checked_without_a_python_step_per_token() -> None:
    """Regression: ``all(type(t) is int for t in tokens)`` ran 131,073 generator steps for a
    max-size prompt (most of the scheduler's 57-80 ms per admission)."""
    calls, req = python_calls(data_plane.request_from_wire, wire())
    assert req.token_ids == TOKENS
    assert calls < 2_000, f"{calls} Python calls to check {len(TOKENS)} token ids"


@pytest.mark.parametrize(("fields", "error"), [
    ({"token_ids": [1, True]}, TypeError), ({"token_ids": [1.0]}, TypeError), ({"token_ids": ["1"]}, TypeError),
    ({"token_ids": [None]}, TypeError), ({"token_ids": [[1]]}, TypeError), ({"token_ids": [-1]}, ValueError),
    ({"token_ids": [MAX_TOKEN_ID + 1]}, ValueError), ({"token_ids": [1 << 70]}, ValueError),
    ({"stop_token_ids": [True]}, TypeError), ({"stop_token_ids": [1.5]}, TypeError),
    ({"allowed_token_ids": [1, False]}, TypeError), ({"stop": ["a", 1]}, TypeError),
    ({"logit_bias": [[True], [1.0]]}, TypeError), ({"logit_bias": [[1], [True]]}, TypeError),
    ({"logit_bias": [[1], ["1"]]}, TypeError),
])
def test_the_checks_refuse_what_they_refused(fields: dict[str, Any], error: type) -> None:
    """Bools, non-integers and ids out of [0, 2**31) are still refused, in every token-id
    field; the scheduler (``check_tokens=False``) leaves ``token_ids`` to the node, whose
    ``submit`` reads them with the default, which refuses."""
    tokens = fields.pop("token_ids", [1, 2])
    with pytest.raises(error):
        data_plane.request_from_wire(wire(tokens, **fields))
    if not fields:  # token_ids alone: what the scheduler passes on, unread
        assert list(data_plane.request_from_wire(wire(tokens), check_tokens=False).token_ids) == tokens


def test_the_schedulers_admission_makes_no_python_step_per_token_or_hash() -> None:
    """The real ``GlobalSchedulerService._answer`` of a max-size admission (131,072 token ids,
    8,192 block hashes), submitted to a node's real command socket: a bounded number of
    Python calls (before: ~140,000)."""
    async def go() -> None:
        sched = GlobalSchedulerService(tempfile.mkdtemp(prefix="kvstrata-cost-"), {"n0": 8})
        know_tenants(sched, "t")
        node = zmq.Context.instance().socket(zmq.PULL)
        node.setsockopt(zmq.LINGER, 0)
        port = node.bind_to_random_port("tcp://127.0.0.1")
        sched.attach_nodes({"n0": f"tcp://127.0.0.1:{port}"})
        try:
            hashes = [hashlib.sha256(i.to_bytes(4, "little")).digest() for i in range(len(TOKENS) // 16)]
            payload = data_plane.pack({"id": 1, "req": wire(), "sub": "tcp://127.0.0.1:1", "hashes": hashes})
            calls, reply = python_calls(sched._answer, payload)
            assert reply["adm"]["code"] == "OK", reply
            submit = data_plane.unpack(node.recv())
            assert submit["op"] == "submit" and len(submit["req"]["token_ids"]) == len(TOKENS)
            assert calls < 5_000, f"{calls} Python calls for one admission of {len(TOKENS)} token ids"
        finally:
            node.close()
            sched.close_data_plane()
            sched.store.close()

    asyncio.run(go())
