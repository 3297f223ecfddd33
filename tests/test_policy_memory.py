"""Memory a KV policy holds outside the pool blocks (codes, sentence index, recall region,
untiered host RAM) is charged to the pool as whole blocks, reported per request and tenant."""

from __future__ import annotations

import torch

from cache_node.policies.sentencekv import PrivateHostKV
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine

# the tiny Llama: 2 layers, 2 KV heads, head_dim 16, float32; blocks of 16 tokens
BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4  # 8192
QUANT8_TOKEN_BYTES = 2 * 2 * 2 * (16 + 2 + 2)  # (L, K/V, H_kv) x (16 int8 codes + fp16 scale + zero)


def prompt_of(n: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 500 + 1 for i in range(n)]


def run_until(eng, rid: str, num_outputs: int):
    while len(eng.requests[rid].output_token_ids) < num_outputs:
        eng.step()
    return eng.requests[rid]


def test_quant_codes_are_charged_to_the_pool_and_reported_per_request_and_tenant(tiny) -> None:
    """issue 18 fault 9: memory a policy holds outside the pool (quant codes) was not counted
    against the pool or the tenant's quota."""
    eng = make_engine(tiny)
    total = eng.kv_manager.pool.num_blocks
    rid = eng.add_request(prompt_of(100), SamplingParams(max_tokens=21, ignore_eos=True), tenant="t",
                          policy="quant-bits_8-window_tokens_0")
    seq = run_until(eng, rid, 20)  # positions 4..116 are codes, 0..3 and 117..118 in the pool
    codes = 113 * QUANT8_TOKEN_BYTES  # 18080 bytes -> 3 charge blocks
    assert seq.kv.extra["quant"].nbytes == codes
    assert len(seq.block_table) == 1 and len(seq.kv.charge_blocks) == 3 and seq.kv.charge_debt == 0
    assert eng.kv_manager.pool.num_free_blocks() == total - 4
    assert eng.held_by_tenant() == {"t": {"blocks": 4, "policy_bytes": codes}}
    stats = eng.stats()
    assert (stats["policy_bytes"], stats["policy_blocks"], stats["used_blocks"]) == (codes, 3, 4)
    final = next(o for o in eng.step() if o.request_id == rid)
    assert (final.finish_reason, final.policy_bytes) == ("length", codes)  # the peak, kept at finish
    assert eng.held_by_tenant() == {} and eng.kv_manager.pool.num_free_blocks() == total
    eng.check_integrity()


def test_a_full_pool_refuses_the_charge_and_the_sequence_does_not_run_on_uncharged(tiny) -> None:
    """issue 18 fault 9: when the pool has no block for the codes a compaction made, the charge
    is a debt the next slot allocation must pay; it cannot, so the sequence stops instead of
    holding more than the pool (alone, it can never come back: it finishes with length)."""
    eng = make_engine(tiny)
    pool = eng.kv_manager.pool
    rid = eng.add_request(prompt_of(100), SamplingParams(max_tokens=40, ignore_eos=True),
                          policy="quant-bits_8-window_tokens_0-evict_every_8")
    seq = run_until(eng, rid, 1)  # prefill: 96 tokens quantized -> 15360 bytes, 2 blocks
    assert (len(seq.kv.charge_blocks), seq.kv.charge_debt) == (2, 0)
    held_elsewhere = pool.allocate(pool.num_free_blocks())
    while seq.kv.num_compactions < 2:  # 9 decodes later, 9 more tokens become codes
        eng.step()
    assert seq.kv.extra["quant"].nbytes == 105 * QUANT8_TOKEN_BYTES  # 16800 bytes: 3 blocks
    assert (len(seq.kv.charge_blocks), seq.kv.charge_debt) == (2, 1)
    outputs = len(seq.output_token_ids)
    eng.step()  # the debt cannot be paid, alone: given up, its blocks and charge given back
    # (not preempted: alone with every other block freed it would only come back to the same
    # point, every step; ``Preemption._reserve``, hangs review H1)
    assert eng.scheduler.num_preemptions == 0 and seq.block_table == [] and seq.kv.charge_blocks == []
    final = next(o for o in eng.step() if o.request_id == rid)
    assert (final.finish_reason, final.num_output_tokens) == ("length", outputs)
    pool.free(held_elsewhere)
    assert pool.num_free_blocks() == pool.num_blocks
    eng.check_integrity()


def test_sentencekv_without_a_host_tier_charges_its_cpu_copies_to_the_pool(tiny) -> None:
    """issue 18 fault 9: without a host tier, sentencekv's demoted K/V and region codes (and its
    key bounds) sat in unbounded CPU tensors; now they are charged to the device pool with its
    index and region."""
    eng = make_engine(tiny)
    rid = eng.add_request(prompt_of(200), SamplingParams(max_tokens=4, ignore_eos=True), tenant="t",
                          policy="sentencekv-96-bound_tier_host")  # with its key bounds
    seq = run_until(eng, rid, 2)
    store = seq.kv.extra["sentences"]
    assert isinstance(store.host, PrivateHostKV)
    demoted = len(torch.cat(store.positions))
    raw = demoted * 2 * 2 * 2 * 16 * 4  # (L, K/V, H_kv, d) float32 per token
    bounds = seq.kv.extra["key_bounds"].nbytes  # the recall bound's key bounds, host side (CPU)
    expected = store.index_nbytes + store.region_nbytes + raw + demoted * QUANT8_TOKEN_BYTES + bounds
    assert store.codes.nbytes == demoted * QUANT8_TOKEN_BYTES and store.host.nbytes == raw
    assert seq.kv.outside_pool_bytes() == expected
    assert len(seq.kv.charge_blocks) == -(-expected // BLOCK_BYTES)
    assert eng.held_by_tenant()["t"] == {"blocks": len(seq.block_table) + len(seq.kv.charge_blocks),
                                         "policy_bytes": expected}
    eng.abort_request(rid)
    eng.step()
    assert eng.kv_manager.pool.num_free_blocks() == eng.kv_manager.pool.num_blocks
    eng.check_integrity()
