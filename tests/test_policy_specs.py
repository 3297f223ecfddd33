"""Policy specs come from the network (a request's or a tenant's ``policy``): every value is
checked against its field's type and range before a policy exists, so no spec reaches a cache
node's step loop with a value that raises there.

Regression: ``snapkv-inf`` (``int(inf)``), ``snapkv-sink_tokens_1.5`` (a float ``topk`` k) and
``quant-group_size_0`` (``unflatten``) passed ``add_request`` and raised inside ``step``: the
node's step loop died and every tenant on it got UNAVAILABLE."""

from __future__ import annotations

from dataclasses import fields

import pytest

from cache_node.config import EngineConfig
from cache_node.engine import LLMEngine
from cache_node.outputs import InvalidRequestError
from cache_node.policies import PolicyEnv, make_policy, parse_spec, registry
from cache_node.policies.quant import channel_group
from cache_node.sampling_params import SamplingParams
from cache_node.tiers.manager import TierConfig
from tests.conftest import make_engine

INTS = ["0", "1", "3", "-1", str(registry.MAX_FIELD_INT)]
FLOATS = ["0", "1.5", "-0.5", "1000000000"]
STRS = ["x", "auto"]


@pytest.mark.parametrize("spec", [
    "snapkv-inf", "h2o-1e999", "snapkv-nan", "gkv-decay_nan", "snapkv-sink_tokens_1.5", "snapkv-sink_tokens_1e3",
    "snapkv-sink_tokens_inf", "snapkv-window_tokens_x", f"h2o-{registry.MAX_FIELD_INT + 1}",
    f"h2o-sink_tokens_{registry.MAX_FIELD_INT + 1}", "quant-group_size_0", "quant-group_size_-16",
    "sentencekv-sketch_group_0", "sentencekv-max_sentence_tokens_0", "sentencekv-last_query_share_1.5",
    "gkv-lam_2", "gkv-decay_0", "spindlekv-shallow_fraction_1.5", "spindlekv-merge_threshold_-2",
    "snapkv-kernel_size_2", "snapkv-kernel_size_1025", "snapkv-nosuch_1",
])
def test_a_spec_with_a_bad_value_is_a_value_error_naming_the_field(spec: str) -> None:
    with pytest.raises(ValueError) as err:
        make_policy(spec)
    field = spec.split("-", 1)[1].rpartition("_")[0] or "budget"
    assert field in str(err.value) or "bad part" in str(err.value)


def test_values_take_their_fields_types() -> None:
    _, kw = parse_spec("sentencekv-0.125-deep_from_1-layer_budget_mass-preset_1-sketch_rank_32")
    assert kw == {"budget": 0.125, "deep_from": 1, "layer_budget": "mass", "preset": "1", "sketch_rank": 32}
    assert isinstance(parse_spec("h2o-256")[1]["budget"], int)


def test_the_engine_refuses_a_bad_spec_as_invalid_request(tiny) -> None:
    eng = make_engine(tiny)
    for spec in ("snapkv-inf", "snapkv-sink_tokens_1.5", "quant-group_size_0"):
        with pytest.raises(InvalidRequestError):
            eng.add_request([1, 2, 3], policy=spec)
    assert not eng.requests and eng.stats()["used_blocks"] == 0


def test_channel_groups_tile_the_channels() -> None:
    assert [channel_group(g, 64) for g in (1, 16, 32, 64, 128, 3, 48)] == [1, 16, 32, 64, 64, 1, 16]
    assert channel_group(64, 96) == 32


def test_every_field_of_every_policy_is_refused_or_runs(tiny) -> None:
    """Each field of each policy at edge values: ``make_policy`` refuses it with ValueError, or
    a short and a 150-token request under it run to their end (no exception from a step) and
    leave the pool consistent. Specs run 16 at a time in one batch; a batch that raises is
    run again spec by spec to name the one at fault."""
    eng = LLMEngine(tiny.model, EngineConfig(block_size=16, kv_pool_bytes=8 << 20, max_num_batched_tokens=512,
                                             max_num_seqs=32),
                    tiny.model_id, tiny.eos_token_ids, tier_config=TierConfig(host_bytes=8 << 20))
    eng.policy_env = PolicyEnv(frozenset({13}))  # token 13 ends a sentence
    prompts = [[(7 * i) % 400 + 1 if i % 9 else 13 for i in range(n)] for n in (10, 150)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    runnable, refused = [], 0
    for name, cls in sorted(registry.REGISTRY.items()):
        for f in fields(cls):
            for value in {"int": INTS, "float": FLOATS}.get(str(f.type), STRS):
                spec = f"{name}-{value}" if f.name == "budget" else f"{name}-{f.name}_{value}"
                try:
                    make_policy(spec)
                except ValueError:
                    refused += 1
                    continue
                runnable.append(spec)

    def run(specs: list[str]) -> None:
        ids = [eng.add_request(p, params, policy=spec) for spec in specs for p in prompts]
        done = {}
        while len(done) < len(ids):
            done |= {o.request_id: o for o in eng.step() if o.finished}
        assert all(len(done[i].output_token_ids) == 4 for i in ids)

    for k in range(0, len(runnable), 16):
        group = runnable[k : k + 16]
        try:
            run(group)
        except Exception:
            for rid in list(eng.requests):
                eng.abort_request(rid)
            eng.step()
            for spec in group:  # name the spec at fault
                try:
                    run([spec])
                except Exception as exc:
                    raise AssertionError(f"policy spec {spec!r} raised in a step: {exc!r}") from exc
            raise
        eng.check_integrity()
    assert len(runnable) > 120 and refused > 80
    assert eng.stats()["used_blocks"] == 0
