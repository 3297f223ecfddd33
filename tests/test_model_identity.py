"""Model identity in block keys: a digest of config and weights, never a directory name."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from cache_node import model_loader
from cache_node.model_loader import load_model, model_identity, tiny_llama
from cache_node.tiers.spill_format import BlockFormat
from cache_node.tiers.spill_store import SpillStore
from tests.test_tier_engine import by_tier, prompt_of, run, tiered

P = prompt_of(200, 5)  # 12 reusable blocks (192 tokens)


def save_checkpoint(parent: Path, seed: int) -> Path:
    """A tiny random Llama of ``seed`` with a word-level tokenizer, saved as ``parent/ckpt``."""
    path = parent / "ckpt"
    tiny_llama(seed=seed).model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(512)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(path)
    return path


def test_model_swap_over_a_shared_spill_dir_serves_no_stale_kv(tmp_path: Path) -> None:
    """issue 18 fault 6: two different checkpoints saved as A/ckpt and B/ckpt both had
    model_id "ckpt"; engine B over A's spill directory was served A's 192 cached tokens and
    its output differed from its cold output. B must get no spill hit from A's blocks."""
    lm_a = load_model(save_checkpoint(tmp_path / "A", seed=1))
    lm_b = load_model(save_checkpoint(tmp_path / "B", seed=2))
    assert lm_a.model_id != lm_b.model_id
    spill_dir = tmp_path / "spill"
    block_format = BlockFormat(*tiered(lm_a).spill_block_spec())
    store_a = SpillStore(spill_dir, block_format, 0, 1 << 30, max_blocks_per_file=4)
    eng_a = tiered(lm_a, spill=store_a)
    run(eng_a, P)
    eng_a.demote_all(to_spill=True)
    eng_a.wait_for_transfers()
    assert store_a.stats()["blocks_spill_disk"] == 12

    cold_b = run(tiered(lm_b), P)
    store_a.close()  # a restart: the old process is gone, its lock with it
    store_b = SpillStore(spill_dir, block_format, 0, 1 << 30, max_blocks_per_file=4)  # restart
    assert store_b.stats()["blocks_spill_disk"] == 12  # A's blocks are all there to be misused
    out = run(tiered(lm_b, spill=store_b), P)
    assert out.num_cached_tokens_by_tier == by_tier()
    assert out.output_token_ids == cold_b.output_token_ids
    assert (store_b.stats()["hits_spill_disk"], store_b.stats()["hits_spill_ram"]) == (0, 0)


def test_identity_is_cached_beside_the_checkpoint_and_follows_the_weights(tmp_path: Path) -> None:
    """issue 18 fault 6: the digest is computed once per weight files' size+mtime, and a
    changed weight file gives a new identity."""
    path = save_checkpoint(tmp_path, seed=1)
    first = model_identity(path)
    cache_file = path / model_loader.IDENTITY_FILE
    cached = json.loads(cache_file.read_text())
    assert cached["identity"] == first and first.startswith("ckpt@")
    cache_file.write_text(json.dumps(cached | {"identity": "ckpt@from-cache"}))
    assert model_identity(path) == "ckpt@from-cache"  # not recomputed while files are unchanged
    tiny_llama(seed=2).model.save_pretrained(path)  # new weights in place
    second = model_identity(path)
    assert second not in (first, "ckpt@from-cache")
    assert load_model(path).model_id == f"{second}:float32"  # weights dtype appended


def test_tiny_llama_identity_differs_per_seed_and_config() -> None:
    """issue 18 fault 6: models built in code get an identity per seed and config."""
    ids = [
        tiny_llama(seed=0).model_id,
        tiny_llama(seed=1).model_id,
        tiny_llama(seed=0, num_layers=3).model_id,
        tiny_llama(seed=0, vocab_size=256).model_id,
    ]
    assert len(set(ids)) == 4
    assert tiny_llama(seed=0).model_id == ids[0]


def _rewrite_in_place_keeping_mtime(f: Path) -> None:
    """Flip one byte near the end of ``f`` (same size) and restore its atime and mtime, as
    ``cp -p``, ``rsync -a`` or a build with normalized timestamps leaves a rewritten file."""
    st = f.stat()
    with open(f, "r+b") as fh:
        fh.seek(st.st_size - 3)
        byte = fh.read(1)
        fh.seek(st.st_size - 3)
        fh.write(bytes([byte[0] ^ 0x40]))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (f.stat().st_size, f.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_weights_rewritten_at_the_same_size_and_mtime_get_a_new_identity(tmp_path: Path) -> None:
    """review 26b F1: the identity cache was keyed by name, size and mtime; weights rewritten
    in place at the same size with the mtime restored kept the old identity (and a node on
    the new weights was served the old weights' KV from the spill tier)."""
    path = save_checkpoint(tmp_path, seed=1)
    first = model_identity(path)
    _rewrite_in_place_keeping_mtime(path / "model.safetensors")
    assert model_identity(path) != first


def test_a_copied_checkpoint_with_its_identity_file_is_hashed_anew(tmp_path: Path) -> None:
    """review 26b F1: ``cp -rp`` carries the identity file along with size and mtime; the copy
    (a new inode) must not take the cached identity on trust once its weights differ."""
    path = save_checkpoint(tmp_path / "a", seed=1)
    first = model_identity(path)
    copy = tmp_path / "b" / "ckpt"
    shutil.copytree(path, copy)  # copy2: sizes and mtimes kept, identity file included
    _rewrite_in_place_keeping_mtime(copy / "model.safetensors")
    assert model_identity(copy) != first


def test_kv_of_another_kv_code_version_is_never_served(tmp_path: Path, monkeypatch) -> None:
    """Regression (review 27b O1): how KV is computed keyed nothing, so spill files written by
    an older kvstrata (same weights, dtype, shape) would be served after an upgrade that
    changed, say, the RoPE convention. ``KV_CODE_VERSION`` is in ``kv_format``: a node of
    another version gets no hit from the old files (they are skipped as another format), while
    a restart at the same version is served all 12 blocks."""
    from cache_node import kv_format  # (where KV_CODE_VERSION lives: kv_pool re-exports it)

    lm = tiny_llama(seed=3)
    spill_dir = tmp_path / "spill"
    block_format = BlockFormat(*tiered(lm).spill_block_spec())
    assert block_format.kv_format.startswith(f"kv{kv_format.KV_CODE_VERSION}/")
    store = SpillStore(spill_dir, block_format, 0, 1 << 30, max_blocks_per_file=4)
    eng = tiered(lm, spill=store)
    cold = run(eng, P)
    eng.demote_all(to_spill=True)
    eng.wait_for_transfers()
    assert store.stats()["blocks_spill_disk"] == 12

    store.close()  # a restart: the old process is gone, its lock with it
    same = SpillStore(spill_dir, block_format, 0, 1 << 30, max_blocks_per_file=4)  # a restart
    assert run(tiered(lm, spill=same), P).num_cached_tokens_by_tier == by_tier(spill_disk=192)

    monkeypatch.setattr(kv_format, "KV_CODE_VERSION", kv_format.KV_CODE_VERSION + 1)
    newer = tiered(lm)
    new_format = BlockFormat(*newer.spill_block_spec())
    assert new_format.kv_format != block_format.kv_format
    same.close()  # a restart: the old process is gone, its lock with it
    upgraded = SpillStore(spill_dir, new_format, 0, 1 << 30, max_blocks_per_file=4)
    assert upgraded.stats()["blocks_spill_disk"] == 0  # the old files are another format
    out = run(tiered(lm, spill=upgraded), P)
    assert out.num_cached_tokens_by_tier == by_tier()
    assert out.output_token_ids == cold.output_token_ids
