"""SentenceKV's ``preset`` (issue 22, point 4: 8x): the fields a spec leaves out come from
"standard" or "compact", "auto" picking compact at budgets of at most 1/8 of the prompt."""

from __future__ import annotations

import pytest

from cache_node.policies import PolicyEnv
from cache_node.policies.registry import make_policy
from cache_node.policies.sentencekv import SentenceKV
from cache_node.policies.sentencekv.presets import COMPACT_BUDGET, PRESETS
from cache_node.sampling_params import SamplingParams
from tests.conftest import make_engine


def fields_of(policy: SentenceKV) -> dict:
    return {key: getattr(policy, key) for key in PRESETS["standard"]}


@pytest.mark.parametrize(("spec", "preset"), [
    ("sentencekv-0.125", "compact"), ("sentencekv-0.05", "compact"), ("sentencekv-0.25", "standard"),
    ("sentencekv", "standard"), ("sentencekv-1", "standard"), ("sentencekv-64", "standard"),
    ("sentencekv-0.125-preset_standard", "standard"), ("sentencekv-0.5-preset_compact", "compact"),
])
def test_auto_resolves_by_budget_and_an_explicit_preset_wins(spec, preset) -> None:
    policy = make_policy(spec)
    assert policy.resolved_preset == preset
    assert fields_of(policy) == PRESETS[preset]


def test_fields_named_in_the_spec_win_over_the_preset() -> None:
    policy = make_policy("sentencekv-0.125-recall_every_1-region_group_16")
    assert (policy.recall_every, policy.region_group) == (1, 16)
    assert policy.sketch_rank == PRESETS["compact"]["sketch_rank"]
    assert make_policy(f"sentencekv-{COMPACT_BUDGET}").recall_every == 8


def test_unknown_preset_and_bad_fields_are_refused() -> None:
    with pytest.raises(ValueError, match="preset"):
        make_policy("sentencekv-0.125-preset_tiny")
    with pytest.raises(ValueError, match="recall_every"):
        make_policy("sentencekv-0.125-recall_every_0")  # validation runs on the resolved fields


def test_compact_preset_serves_with_integrity(tiny) -> None:
    """The compact preset end to end on the tiny engine: it compresses, recalls and frees."""
    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompts = [[(i * (k + 3)) % 13 + 1 for i in range(600)] for k in range(2)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), policy="sentencekv-0.125")
    assert all(len(o.output_token_ids) == 6 for o in outs)
    assert all(o.policy_bytes > 0 for o in outs)  # each demoted its prompt and held an index/region
    eng.check_integrity()
    assert eng.stats()["used_blocks"] == 0  # every block back once both finished
