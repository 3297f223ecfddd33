"""The quality harness's own parts on the tiny model: decode-step forcing, the threshold sweep's
demote/recall round trip, SentenceKV's per-head selection, the kvpress peer's byte accounting
(with a stand-in press, so it runs without kvpress installed) and the targets check."""

from __future__ import annotations

import contextlib

import torch

from bench.kvpress_peer import Runner, cache_bytes
from bench.kvpress_peer import evaluate_item as peer_evaluate
from bench.quality_probe import Probe
from bench.quality_report import targets
from bench.quality_sweep import demote, recall_all, threshold_plans
from cache_node.compaction import gather_kv
from cache_node.model_loader import tiny_llama
from cache_node.policies import make_policy
from cache_node.policies.sentencekv import HostSentenceStore, SentenceKV
from tests.conftest import make_engine


def test_decode_forcing_matches_one_chunk_when_nothing_is_evicted(tiny) -> None:
    """decode=True (prompt chunk, then one step per forced token) computes the same logits as
    the one-chunk path while the policy's budget holds everything."""
    probe = Probe(make_engine(tiny))
    base, _ = probe.prefill(list(range(1, 81)))
    a, b = probe.compress(base, "h2o-400"), probe.compress(base, "h2o-400")
    chunk = probe.teacher_force(a, [5, 6, 7], [8, 9, 10, 11])
    steps = probe.teacher_force(b, [5, 6, 7], [8, 9, 10, 11], decode=True)
    assert chunk.shape == steps.shape == (5, tiny.model.config.vocab_size)
    assert torch.allclose(chunk, steps, atol=1e-4)


def test_threshold_demotion_then_recall_restores_every_token_exactly(tiny) -> None:
    probe = Probe(make_engine(tiny))
    base, _ = probe.prefill(list(range(1, 121)))
    seq = probe.fork(base, make_policy("h2o"))
    L = seq.kv.pool.num_layers
    before = gather_kv(seq.kv.pool, seq, torch.arange(120).unsqueeze(0).expand(L, -1)).clone()
    loose, strict = threshold_plans(seq, 0.0), threshold_plans(seq, 0.5)
    assert all(len(p.keep) == 120 for p in loose)  # tau 0 demotes nothing
    assert all(len(s.keep) < 120 for s in strict)
    host, host_pos = demote(seq, strict)
    kept = seq.kv.kept_counts()
    assert [k + len(p) for k, p in zip(kept, host_pos)] == [120] * L
    assert recall_all(seq, host, host_pos) > 0
    assert torch.equal(seq.kv.positions, torch.arange(120).expand(L, -1))
    after = gather_kv(seq.kv.pool, seq, torch.arange(120).unsqueeze(0).expand(L, -1))
    assert torch.equal(after, before)


def test_sentencekv_select_gives_each_head_its_best_and_the_last_query_first() -> None:
    store = HostSentenceStore()
    for start in range(0, 40, 8):  # five sentences of 8 tokens at positions 0, 8, ..., 32
        store.positions.append(torch.arange(start, start + 8))
    policy = SentenceKV(last_query_share=0.5)
    per_head = torch.tensor([[0.9, 0.1, 0.8, 0.0, 0.0], [0.0, 0.2, 0.1, 0.95, 0.3]])  # (H_kv, S)
    assert policy.select(store, [per_head], 16) == ((0, 2), (3, 4))  # each head its own best
    assert policy.select(store, [per_head], 8) == ((0,), (3,))
    last = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
    assert policy.select(store, [last, per_head], 16) == ((0, 4), (3, 4))  # the last query's pick first


class KeepLast:
    """Stand-in press: keeps the last ``keep`` context tokens (a real gather, like kvpress's
    scorer presses)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep

    @contextlib.contextmanager
    def __call__(self, model):
        yield
        cache = self.cache
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, -self.keep :], layer.values[:, :, -self.keep :]


def test_peer_reports_the_bytes_the_cache_really_holds(monkeypatch) -> None:
    from collections import defaultdict

    import bench.kvpress_peer as peer

    tiny = tiny_llama(seed=3)  # plain HF attention: the peer runs the model without the engine
    runner = Runner(tiny.model)
    press = KeepLast(16)
    real_prefill = runner.prefill

    def prefill(context, p):  # the stand-in cuts the cache after the prefill, as a hook would
        cache = real_prefill(context, None)
        if p is not None:
            p.cache = cache
            with p(tiny.model):
                pass
        return cache

    monkeypatch.setattr(runner, "prefill", prefill)
    monkeypatch.setattr(peer, "make_press", lambda name, keep: press)
    item = {"context": list(range(1, 65)), "held": [3, 4, 5, 6],
            "questions": [{"kind": "passkey", "prompt": [7, 8], "gen": [9, 10], "need": 2, "full_ok": True}]}
    rows: dict = defaultdict(lambda: defaultdict(list))
    peer_evaluate(runner, item, [("kvpress.stub-0.25", "stub", 0.25)], rows)
    row = rows["kvpress.stub-0.25"]
    assert row["device_bytes_ratio"] == [16 / 64]
    assert len(row["kl"]) == 1 and row["kl"][0] >= 0 and len(row["acc_passkey"]) == 1
    full = runner.prefill(item["context"], None)
    assert cache_bytes(full) == 2 * tiny.model.config.num_hidden_layers * 64 * 2 * 16 * 4
    before = cache_bytes(full)
    runner.force(full, [1, 2, 3], 64)  # forcing leaves the cache as it was
    assert cache_bytes(full) == before


def test_targets_are_checked_against_the_numbers() -> None:
    summary = {
        "sentencekv-0.25": {"passkey_acc": 1.0, "kl_mean": 0.04, "greedy_agreement": 0.9, "device_bytes_ratio": 0.25},
        "kvpress.snapkv-0.25": {"passkey_acc": 0.5, "kl_mean": 1.0, "greedy_agreement": 0.5, "device_bytes_ratio": 0.25},
        "quant-bits_4": {"passkey_acc": 1.0, "kl_mean": 0.02, "greedy_agreement": 0.79, "device_bytes_ratio": 0.22},
    }
    got = targets(summary)
    assert got["sentencekv_passkey_within_2pts"] and got["sentencekv_kl_below_0.05"]
    assert got["sentencekv_beats_every_press_on_passkey"]
    assert not got["quant-bits_4_agreement_ge_0.8"] and got["quant-bits_4_at_least_2x_fewer_bytes"]
    summary["sentencekv-0.25"]["n_passkey"] = 0  # the full cache answered no pass key: not measured
    assert targets(summary)["sentencekv_passkey_within_2pts"] is None


def test_kl_to_the_answer_leaves_out_the_rows_after_it() -> None:
    """``score``: KL over every row of the answer, and ``kl_answer`` over the rows up to the
    last needed token only; a change after the answer shows in the first, not the second."""
    from collections import defaultdict

    from bench.quality import score

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(5, 11, generator=g)
    got = ref.clone()
    got[3:] = torch.randn(2, 11, generator=g)  # rows 3 and 4: after an answer of need=3 tokens
    row: dict = defaultdict(list)
    score(row, "passkey", ref, got, 3, True)
    assert row["kl"][0] > 0.01 and abs(row["kl_answer"][0]) < 1e-6 and row["acc_passkey"] == [1.0]
    score(row, "word", ref, got, None, False)  # no needed length: no answer KL
    assert len(row["kl"]) == 2 and len(row["kl_answer"]) == 1
