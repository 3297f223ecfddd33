"""Prompt logprobs from a cache node to a gRPC client: the node sends them in deltas with no token
id (``PROMPT_LOGPROBS_PER_EVENT`` entries at most each), the gateway checks every entry's shape,
types and values, that they are what the request asked and no more than its prompt has (a bad
one ending its own stream alone), a slow reader's buffer coalesces and counts them, and
``services.convert`` carries ``prompt_logprobs`` both ways and the entries into
``GenerateDelta.prompt_logprobs``. Served end to end (the tiny checkpoint's node, scheduler and
gateway gRPC server): equal to a transformers forward's log_softmax, the same with the prefix
cache warm, and bad values INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import grpc
import msgpack
import pytest
import torch
from transformers import LlamaForCausalLM

from bench.chaos_stack import tiny_checkpoint
from cache_node.outputs import PromptLogprob, RequestOutput
from cache_node.sampling_params import SamplingParams
from kvstrata.v1 import inference_pb2
from services import cache_node_streams, data_plane, data_plane_wire
from services.convert import generate_event_to_pb, sampling_params_from_pb, sampling_params_to_pb
from services.gateway_inputs import GenerateInput
from services.gateway_prepare import RequestPreparation
from services.gateway_stream_bounds import StreamBuffer, event_bytes
from services.gateway_streams import _Entry
from services.global_scheduler_routing import prompt_size
from services.node_request import NodeRequest, entry_prompt_logprobs, prompt_logprobs_entry
from tenants.model import TenantSpec
from tests.gateway_harness import NODE_INFO
from tests.test_logprobs_served import PROMPT, Served

ENTRY = [42, -0.5, 2, 7, -0.25, 42, -0.5]  # token 42 (rank 2) and the top 2


def _delta(*entries: list, tokens: list[int] | None = None) -> dict:
    return {"type": "delta", "token_ids": tokens or [], "text": "", "prompt_logprobs": list(entries)}


def test_an_entry_is_flat_and_reads_back() -> None:
    assert prompt_logprobs_entry(42, -0.5, 2, [(7, -0.25), (42, -0.5)]) == ENTRY
    assert entry_prompt_logprobs(ENTRY) == (42, -0.5, 2, [(7, -0.25), (42, -0.5)])


def test_the_node_splits_a_steps_entries_into_deltas_with_no_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_node_streams, "PROMPT_LOGPROBS_PER_EVENT", 2)
    out = RequestOutput("r", (), False, None, 6, 0, 0, 0, None,
                        prompt_logprobs=tuple(PromptLogprob(t, -1.0, 1) for t in range(5)))
    events = cache_node_streams._prompt_logprobs_events(out)
    assert [len(e["prompt_logprobs"]) for e in events] == [2, 2, 1]
    assert all(e["token_ids"] == [] and e["text"] == "" and data_plane.check_event(e) for e in events)


@pytest.mark.parametrize("entry", [
    [42, -0.5],  # no rank
    [42, -0.5, 2, 7],  # an id without its logprob
    [42, -0.5, 0],  # rank 0
    [42, -0.5, 2.0],  # a float rank
    [42.0, -0.5, 1],  # a float token
    [-1, -0.5, 1],  # a negative token
    [1 << 31, -0.5, 1],  # past MAX_TOKEN_ID
    [42, math.nan, 1],
    [42, 0.5, 1],
    [42, -0.5, 1, 7, -1.0, 7, -2.0],  # an id twice
    [42, -0.5, 1, 7, -2.0, 8, -1.0],  # top out of order
    [42, -0.5, 1] + [1, -1.0] * 21,  # past MAX_LOGPROBS
    "x", {"token": 42},
])
def test_malformed_entries_are_refused_naming_the_field(entry: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="event.prompt_logprobs"):
        data_plane.check_event(_delta(entry))


def test_entries_on_another_event_or_not_asked_are_refused() -> None:
    with pytest.raises(ValueError, match="event.prompt_logprobs"):
        data_plane.check_event({"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 3,
                                "prompt_logprobs": [ENTRY]})
    event = data_plane.check_event(_delta(ENTRY))
    data_plane.check_logprobs_asked(event, None, 2)
    for asked in (None, 0, 3):
        with pytest.raises(ValueError, match="event.prompt_logprobs"):
            data_plane.check_logprobs_asked(event, None, asked)


def test_the_gateway_takes_no_more_entries_than_the_prompt_has_nor_after_a_token() -> None:
    entry = _Entry("n", StreamBuffer(), None, prompt_logprobs=2)
    with pytest.raises(ValueError, match="event.prompt_logprobs past"):  # none before its started event
        entry.check_prompt_count(_delta(ENTRY))
    started = {"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 3}
    entry.check_prompt_count(started)
    entry.check_prompt_count(_delta(ENTRY))
    entry.check_prompt_count(started)  # a second one (the buffer drops it) counts nothing
    with pytest.raises(ValueError, match="event.prompt_logprobs past"):
        entry.check_prompt_count(_delta(ENTRY, ENTRY))
    entry.check_prompt_count(_delta(ENTRY, tokens=[5]))
    with pytest.raises(ValueError, match="event.prompt_logprobs past"):
        entry.check_prompt_count(_delta(ENTRY))


def test_a_slow_readers_buffer_coalesces_and_counts_them() -> None:
    buffer = StreamBuffer()
    first, second = _delta(ENTRY), {**_delta(ENTRY), "token_ids": [9], "text": "a"}
    buffer.put_nowait(first)
    buffer.put_nowait(second)
    assert buffer.undelivered_bytes == event_bytes(first) + event_bytes(second) == 2 * (8 * 7 + 4) + 8
    got = buffer.get_nowait()
    assert got["prompt_logprobs"] == [ENTRY, ENTRY] and got["token_ids"] == [9] and buffer.undelivered_bytes == 0
    assert all(type(v) is int for v in (got["prompt_logprobs"][0][0], got["prompt_logprobs"][0][2]))


def test_convert_and_the_request_wire_carry_prompt_logprobs() -> None:
    for params in (SamplingParams(max_tokens=3, prompt_logprobs=0), SamplingParams(max_tokens=3, prompt_logprobs=20),
                   SamplingParams(max_tokens=3)):
        assert sampling_params_from_pb(sampling_params_to_pb(params)) == params
        wire = data_plane_wire.request_to_wire(NodeRequest("r", "t", "ns", sampling=params, token_ids=(1, 2)))
        assert data_plane_wire.request_from_wire(msgpack.unpackb(msgpack.packb(wire))).sampling == params
    with pytest.raises(ValueError, match="sampling.prompt_logprobs"):
        sampling_params_from_pb(inference_pb2.SamplingParams(max_tokens=1, prompt_logprobs=21))
    delta = generate_event_to_pb(_delta(ENTRY)).delta
    assert [(e.token_id, e.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top]) for e in delta.prompt_logprobs] \
        == [(42, -0.5, 2, [(7, -0.25), (42, -0.5)])]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def _prompt_entries(responses: list[inference_pb2.GenerateResponse]) -> list[Any]:
    deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta"]
    first = next(i for i, d in enumerate(deltas) if d.token_ids)
    assert not any(d.prompt_logprobs for d in deltas[first + 1:])  # all before the first token's delta
    return [e for d in deltas for e in d.prompt_logprobs]


def test_grpc_streams_the_prompts_logprobs_as_a_forward_gives_them(served: Served) -> None:
    model = LlamaForCausalLM.from_pretrained(str(tiny_checkpoint()), torch_dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)[:-1]
    runs = [_prompt_entries(served.generate(max_tokens=2, prompt_logprobs=3)) for _ in range(2)]  # then cache warm
    for entries in runs:
        assert [e.token_id for e in entries] == PROMPT[1:]
        for i, e in enumerate(entries):
            row = rows[i]
            assert e.logprob == pytest.approx(float(row[PROMPT[i + 1]]), abs=1e-4)
            assert e.rank == int((row > row[PROMPT[i + 1]]).sum()) + 1
            assert [t.token_id for t in e.top] == row.topk(3).indices.tolist()
    plain = served.generate(max_tokens=2)
    assert all(not r.delta.prompt_logprobs for r in plain if r.WhichOneof("event") == "delta")


@pytest.mark.parametrize(("fields", "start"), [
    ({"prompt_logprobs": 21}, "sampling.prompt_logprobs must"),
    ({"prompt_logprobs": 0, "prefix": 4}, "prompt_logprobs: not served with prefix_tokens"),
])
def test_grpc_bad_prompt_logprobs_are_invalid_argument_naming_the_field(served: Served, fields: dict,
                                                                        start: str) -> None:
    prefix = fields.pop("prefix", 0)
    request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=PROMPT), prefix_tokens=prefix,
                                            sampling=inference_pb2.SamplingParams(max_tokens=2, **fields))
    with pytest.raises(grpc.RpcError) as info:
        list(served.stub.Generate(request, metadata=(("authorization", f"Bearer {served.key}"),), timeout=60))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(start)


class _Preparation(RequestPreparation):
    """The gateway's request preparation alone (``InferenceServicer``'s attributes it reads)."""

    def __init__(self) -> None:
        self.info = {**NODE_INFO, "vocab_size": 1000}
        self.templater = None
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1)


def test_the_gateway_sends_no_block_hashes_for_prompt_logprobs() -> None:
    """A prompt-logprobs request reads no prefix cache on its node: admission and routing get no
    block hashes for it (a full miss), so its cached prefix is not counted as free work
    (review 28c F6)."""
    tenant = SimpleNamespace(spec=TenantSpec("t"), tenant_id="t", kv_namespace="t")
    preparation = _Preparation()

    def prepare(prompt_logprobs: int | None) -> tuple[NodeRequest, list[bytes]]:
        call = GenerateInput(prompt=list(range(1, 65)),
                             sampling=SamplingParams(max_tokens=2, prompt_logprobs=prompt_logprobs))
        return asyncio.run(preparation._prepare(call, tenant, None))

    try:
        req, hashes = prepare(None)
        assert len(hashes) == 64 // NODE_INFO["block_size"] and len(req.token_ids) == 64
        for k in (0, 5):
            req, hashes = prepare(k)
            assert hashes == [] and len(req.token_ids) == 64 and prompt_size(req) == 64
    finally:
        preparation._tokenizer_pool.shutdown()


def test_the_gateway_checks_the_entries_against_the_prompt_it_sent() -> None:
    """With the prompt's token ids known, the started event must count them, entry i must be
    prompt token i + 1's, and all must come before the first token id (review 28c F5: a node's
    short or shifted entries reached clients as a short or shifted ``prompt_logprobs``)."""
    prompt = (3, 42, 7, 42)

    def entry(token: int) -> list:
        return [token, *ENTRY[1:]]

    def opened() -> _Entry:
        e = _Entry("n", StreamBuffer(), None, prompt_logprobs=2, prompt=prompt)
        e.check_prompt_count({"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 4})
        return e

    good = opened()
    good.check_prompt_count(_delta(entry(42), entry(7)))
    good.check_prompt_count(_delta(entry(42), tokens=[5]))
    with pytest.raises(ValueError, match="event.prompt_tokens 5"):
        _Entry("n", StreamBuffer(), None, prompt_logprobs=2, prompt=prompt).check_prompt_count(
            {"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 5})
    with pytest.raises(ValueError, match="not its prompt position's token"):  # shifted
        opened().check_prompt_count(_delta(entry(7), entry(42)))
    shifted = opened()
    shifted.check_prompt_count(_delta(entry(42)))
    with pytest.raises(ValueError, match="not its prompt position's token"):  # repeated
        shifted.check_prompt_count(_delta(entry(42)))
    short = opened()
    short.check_prompt_count(_delta(entry(42), entry(7)))
    with pytest.raises(ValueError, match="1 of its prompt's entries missing"):
        short.check_prompt_count(_delta(tokens=[5]))
    unknown = _Entry("n", StreamBuffer(), None, prompt_logprobs=2)  # (a session's turn: not known)
    unknown.check_prompt_count({"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 4})
    unknown.check_prompt_count(_delta(entry(1), tokens=[5]))
    plain = _Entry("n", StreamBuffer(), None, prompt=prompt)  # no prompt logprobs asked: no count needed
    plain.check_prompt_count({"type": "started", "request_id": "r", "node_id": "n", "prompt_tokens": 4})
    plain.check_prompt_count(_delta(tokens=[5]))
