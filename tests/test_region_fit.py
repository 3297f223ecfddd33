"""``HostSentenceStore.fit_region``: a compaction during decoding resizes the recall region by a
few slots and keeps what it holds (issue 22: compaction cost at decode)."""

from __future__ import annotations

import pytest
import torch

from cache_node.policies.sentencekv import HostSentenceStore, PrivateHostKV, SentenceCodes


def _store(bits: int) -> HostSentenceStore:
    g = torch.Generator().manual_seed(7)
    store = HostSentenceStore(PrivateHostKV())
    if bits:
        store.codes = SentenceCodes(bits, 16)
    first = 0
    for n in (5, 3, 7, 4, 6, 2, 5):
        store.put(torch.randn(2, n, 2, 3, 16, generator=g), torch.arange(first, first + n))
        first += n
    return store


def _slots(store: HostSentenceStore, layer: int, h: int) -> dict[int, torch.Tensor]:
    parts = [store.region_kv[layer][:, h]]
    if store.region_scale is not None:
        parts += [store.region_scale[layer][:, h], store.region_zero[layer][:, h]]
    pos = store.region_positions[layer][h].tolist()
    return {p: torch.cat([t[:, i].flatten().float() for t in parts]) for i, p in enumerate(pos) if p >= 0}


@pytest.mark.parametrize("bits", [0, 8])
def test_fit_region_shrinks_to_whole_sentences_and_grows_with_empty_slots(bits: int) -> None:
    store = _store(bits)
    store.resize_region([20, 20], torch.zeros(2, 2, 8, 3, 16), bits, 16)
    chosen = ((0, 2, 3), (1, 4, 6), (5,))  # 16, 14 and 2 tokens
    store.load_region(1, chosen, [0, 1, 2])
    store.load_region(1, ((2, 3, 6), (1, 4, 6), (5,)), [0], before=chosen)  # head 0: 6 into 0's slots
    store.resident[1] = ((2, 3, 6), (1, 4, 6), (5,))
    before = [_slots(store, 1, h) for h in range(3)]
    version = store.region_version[1]
    store.fit_region([20, 12])
    assert store.region_positions[1].shape == (3, 12) and store.region_kv[1].shape[2] == 12
    assert store.region_version[1] > version and store.region_positions[0].shape == (3, 20)
    for h in range(3):
        held = store.resident[1][h]
        after = _slots(store, 1, h)
        assert set(after) == {p for s in held for p in store.positions[s].tolist()}  # whole sentences
        assert all(torch.equal(after[p], before[h][p]) for p in after)  # each token's K/V kept
        assert set(store.slot_sentences(1)[h].tolist()) - {-1} == set(held)
    assert store.resident[1][2] == (5,) and len(store.resident[1][0]) < 3 and len(store.resident[1][1]) < 3
    store.fit_region([20, 18])  # grow: empty slots at the end, nothing else moves
    assert store.region_positions[1].shape == (3, 18) and (store.region_positions[1][:, 12:] == -1).all()
    assert all(_slots(store, 1, h).keys() == {p for s in store.resident[1][h] for p in store.positions[s].tolist()}
               for h in range(3))


def test_headroom_blocks_0_gives_the_region_a_block_and_stays_within_budget(tiny) -> None:
    """A real engine: with ``headroom_blocks_0`` the region gets one pool block's worth of
    bytes more, decoding compacts every few tokens (each keeping the regions' selections via
    ``fit_region``), and device bytes never exceed the budget."""
    from cache_node.policies import PolicyEnv
    from cache_node.sampling_params import SamplingParams
    from tests.conftest import make_engine

    eng = make_engine(tiny)
    eng.policy_env = PolicyEnv(frozenset({13}))
    prompt = [(i * 5) % 23 + 1 for i in range(300)]
    regions, outs = {}, {}
    for spec in ("sentencekv-96-region_bits_8", "sentencekv-96-region_bits_8-headroom_blocks_0"):
        rid = eng.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True), policy=spec)
        seq = eng.requests[rid]
        kv = seq.kv
        budget = 96 * kv.policy._token_bytes(kv)
        fits = 0
        real_fit = HostSentenceStore.fit_region

        def counting(self, sizes, _real=real_fit):  # type: ignore[no-untyped-def]
            nonlocal fits
            fits += 1
            return _real(self, sizes)

        HostSentenceStore.fit_region = counting  # type: ignore[method-assign]
        try:
            while not seq.is_finished:
                eng.step()
                if not seq.is_finished and "sentences" in kv.extra:
                    assert kv.device_bytes() <= budget
                    store = kv.extra["sentences"]
                    regions.setdefault(spec, store.region_tokens)
                    for layer, sids in store.resident.items():  # resident = what the slots hold
                        for h, held in enumerate(sids):
                            assert set(store.slot_sentences(layer)[h].tolist()) - {-1} == set(held)
        finally:
            HostSentenceStore.fit_region = real_fit  # type: ignore[method-assign]
        outs[spec] = fits
    plain, tight = regions.values()
    assert tight > plain  # the headroom block's bytes went to the region
    assert outs["sentencekv-96-region_bits_8-headroom_blocks_0"] > outs["sentencekv-96-region_bits_8"] >= 1


def test_headroom_blocks_is_validated() -> None:
    from cache_node.policies.sentencekv import SentenceKV

    assert SentenceKV(budget=0.125).headroom_blocks == 0 and SentenceKV(budget=0.25).headroom_blocks == 1
    for bad in (-1, 0.5):
        with pytest.raises(ValueError, match="headroom_blocks"):
            SentenceKV(budget=0.125, headroom_blocks=bad)
