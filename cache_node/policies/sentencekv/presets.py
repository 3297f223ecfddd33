"""SentenceKV's presets: the field values a spec leaves out, by budget (``SentenceKV.preset``),
with the measurements that chose them.
"""

from __future__ import annotations

# The fields a preset sets when the spec leaves them out (``SentenceKV.preset``). "standard":
# int8 region codes per 16 channels, a 2-bit sketch of every channel, recall every decode step.
# "compact", for an eighth of the device bytes: one int8 scale per token and K/V (groups of
# 64 channels) on keys centred and scaled per channel (KIVI §3), so the bytes go to slots;
# the sketch of the keys' top-32 principal directions (Loki), each divided by its spread, in
# groups of 32; the region's slots split among the layers by where the window queries'
# attention lies (``layer_budget.py``); the last query fills 3/4 of the region; the second half
# of the layers (the deep layers) score on 4-bit codes and reselect every decode step, the
# first half every eighth (Quest/ShadowKV reuse); no headroom block, so the region gets it.
# Those three took the 1k KL over seeds 0-2 from 0.094 to 0.050 and the 2k KL over seeds 0-1
# from 0.057 to 0.047, at TPOT 1.18-1.23x the full cache's, median 1.20x over ten runs
# (bench/README.md "Deep layers", "The headroom block and the layer knobs", "The compact
# preset, ninth session", "One attention call per decode step").
# Measured on SmolLM2-135M (bench/README.md "8x", "The compact preset", "Layer split"): at
# 12.5% compact answered every pass key at 1k-8k where standard lost them at 4k; the layer
# split and whitening took the 4k KL over six contexts from 0.089 to 0.037 (but raised two 1k
# contexts' from 0.043 to 0.102); TPOT ~1.2-1.3x the full cache's against ~1.5x; at 25%
# standard had the lower KL, hence a budget-dependent default.
PRESETS: dict[str, dict[str, int | float | str]] = {
    "standard": {"last_query_share": 0.5, "sketch_group": 16, "sketch_rank": 0, "region_group": 16,
                 "region_key_scale": 0, "recall_every": 1, "sketch_whiten": 0,
                 "layer_budget": "uniform", "recall_next": 0, "deep_from": 1.0, "deep_sketch_bits": 2,
                 "deep_recall_every": 1, "deep_sketch_whiten": 0, "layer_floor": 0.5, "headroom_blocks": 1},
    "compact": {"last_query_share": 0.75, "sketch_group": 32, "sketch_rank": 32, "region_group": 64,
                "region_key_scale": 1, "recall_every": 8, "sketch_whiten": 1,
                "layer_budget": "mass", "recall_next": 0, "deep_from": 0.5, "deep_sketch_bits": 4,
                "deep_recall_every": 1, "deep_sketch_whiten": 1, "layer_floor": 0.5, "headroom_blocks": 0},
}

COMPACT_BUDGET = 0.125  # "auto" picks "compact" at budgets of at most this fraction of the prompt
