"""The converted default model's cache survives crashes: a cache that is not whole is
converted again instead of failing every start (``cache_node.model_files``).

The GGUF dequantization (~20-60 s) is replaced by a tiny Llama and a one-word tokenizer; the
save, the completion record, the check at load and the rebuild are the product's own.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from cache_node import model_files
from cache_node.model_loader import tiny_llama


@pytest.fixture
def conversions(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict[str, torch.Tensor]]:
    """The cache in ``tmp_path``; each conversion makes a tiny Llama (seed = its index) and
    appends its state dict here."""
    monkeypatch.setenv("KVSTRATA_CACHE", str(tmp_path))
    made: list[dict[str, torch.Tensor]] = []

    def dequantize() -> tuple[object, object]:
        model = tiny_llama(seed=len(made)).model
        made.append({k: v.clone() for k, v in model.state_dict().items()})
        return model, _tokenizer()

    monkeypatch.setattr(model_files, "_dequantize_default", dequantize, raising=False)
    return made


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _tokenizer() -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")))


def _seed_cut_short(target: Path) -> None:
    """What the old conversion left after a power loss: renamed into place unsynced, so
    config.json is whole and model.safetensors is empty."""
    tiny_llama(seed=7).model.save_pretrained(target)
    _tokenizer().save_pretrained(target)
    (target / "model.safetensors").write_bytes(b"")


def test_a_conversion_cut_short_by_a_crash_is_converted_again(conversions, caplog) -> None:
    """Regression (s38 durability audit): "done" meant config.json exists, so a cache whose
    model.safetensors a power loss left empty was returned and every start failed loading it
    until someone deleted the directory."""
    target = model_files.cache_dir() / model_files.DEFAULT_MODEL
    _seed_cut_short(target)
    with caplog.at_level(logging.WARNING, logger=model_files.__name__):
        assert model_files.resolve_model_dir() == target
    assert len(conversions) == 1
    assert _same(_weights(target), conversions[0])
    assert f"no {model_files.COMPLETE_FILE}" in caplog.text
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]


def test_a_cached_file_truncated_later_is_converted_again(conversions, caplog) -> None:
    """A whole conversion is used as is (no second conversion); one whose weights were cut
    short since is found at the next start by its size record and converted again."""
    target = model_files.resolve_model_dir()
    assert model_files.resolve_model_dir() == target and len(conversions) == 1
    assert model_files.incomplete_reason(target) is None
    weights = target / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger=model_files.__name__):
        assert model_files.resolve_model_dir() == target
    assert f"model.safetensors is {size // 2} bytes, {size} when saved" in caplog.text
    assert len(conversions) == 2
    assert _same(_weights(target), conversions[1])


@pytest.mark.parametrize("record", [b"", b"\x00" * 100, b'{"files": {"model.safetensors": 1}}', b"[" * 70_000, b"[" * 60_000])
def test_a_torn_or_foreign_completion_record_is_converted_again(conversions, record: bytes) -> None:
    """A completion record that is empty, zeros (a torn write), lacks config.json, or is
    past its bound is not taken for whole: the cache is converted again, no error."""
    target = model_files.resolve_model_dir()
    (target / model_files.COMPLETE_FILE).write_bytes(record)
    assert model_files.incomplete_reason(target) is not None
    assert model_files.resolve_model_dir() == target
    assert len(conversions) == 2
    assert _same(_weights(target), conversions[1])


def test_concurrent_starts_convert_once(conversions, monkeypatch: pytest.MonkeyPatch) -> None:
    """Starts racing on a missing cache convert it once (the others wait on the lock and use
    it), and none removes the directory another is writing."""
    dequantize = model_files._dequantize_default

    def slow() -> tuple[object, object]:
        time.sleep(0.3)  # the window in which, unlocked, a second start began converting too
        return dequantize()

    monkeypatch.setattr(model_files, "_dequantize_default", slow)
    with ThreadPoolExecutor(3) as pool:
        dirs = list(pool.map(lambda _: model_files.resolve_model_dir(), range(3)))
    target = model_files.cache_dir() / model_files.DEFAULT_MODEL
    assert dirs == [target] * 3 and len(conversions) == 1
    assert _same(_weights(target), conversions[0])


def test_a_start_waiting_for_another_conversion_says_so(conversions, caplog) -> None:
    """Regression (s38 review r6): a start behind another process's conversion waited on the
    lock without a word, so one stuck behind a converter that hangs looked hung itself. Now it
    logs the wait, naming the lock file, then goes on once the lock is free."""
    target = model_files.cache_dir() / model_files.DEFAULT_MODEL
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.with_name(f".{target.name}.lock")
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)  # another open file: flock conflicts
    fcntl.flock(held, fcntl.LOCK_EX)
    with caplog.at_level(logging.WARNING, logger=model_files.__name__), ThreadPoolExecutor(1) as pool:
        start = pool.submit(model_files.resolve_model_dir)
        try:
            deadline = time.monotonic() + 10
            while "waiting for another process" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            said = caplog.text
            waited = not start.done() and not conversions  # it waits: nothing converted meanwhile
        finally:
            os.close(held)  # (the start goes on whatever was asserted)
        assert "waiting for another process" in said and str(lock) in said, said
        assert waited
        assert start.result(timeout=60) == target
    assert len(conversions) == 1


def test_a_cache_written_meanwhile_without_a_record_is_replaced(conversions, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (seen converting the shared cache in this audit): a kvstrata from before the
    record, which takes no lock, wrote the directory while this one converted; the rename
    failed, "another process saved it first" kept theirs, and the start returned a cache
    without a record, which every later start converted again. Now one that is not whole is
    replaced by ours."""
    target = model_files.cache_dir() / model_files.DEFAULT_MODEL
    dequantize = model_files._dequantize_default

    def racing() -> tuple[object, object]:
        _seed_cut_short(target)  # the other kvstrata's, unsynced, its weights lost to a crash
        return dequantize()

    monkeypatch.setattr(model_files, "_dequantize_default", racing)
    assert model_files.resolve_model_dir() == target
    assert model_files.incomplete_reason(target) is None
    assert len(conversions) == 1 and _same(_weights(target), conversions[0])
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]


def _unwritable(directory: Path) -> contextlib.AbstractContextManager[None]:
    """``directory`` cannot be written while inside, as a read-only file system or another
    user's cache (root ignores modes: ``chattr +i`` then; skipped where neither works)."""

    @contextlib.contextmanager
    def held() -> Iterator[None]:
        if os.geteuid() != 0:
            directory.chmod(0o555)
            try:
                yield
            finally:
                directory.chmod(0o755)
            return
        chattr = shutil.which("chattr")
        if chattr is None or subprocess.run([chattr, "+i", str(directory)], check=False, capture_output=True).returncode:
            pytest.skip("root without chattr +i: no unwritable directory to test with")
        try:
            yield
        finally:
            subprocess.run([chattr, "-i", str(directory)], check=True)

    return held()


def test_an_older_cache_in_an_unwritable_directory_is_used(conversions, caplog) -> None:
    """Regression (s38 review r6 of 7a86e0a): a conversion an older kvstrata left (no record)
    in a cache that cannot be written (read-only file system, another user's) failed every
    start with the lock file's OSError, where it had loaded before. Now it is used, with a
    warning; a cache with a record that is not whole still raises there (nothing to use)."""
    target = model_files.cache_dir() / model_files.DEFAULT_MODEL
    tiny_llama(seed=7).model.save_pretrained(target)
    _tokenizer().save_pretrained(target)
    with _unwritable(target.parent), caplog.at_level(logging.WARNING, logger=model_files.__name__):
        assert model_files.resolve_model_dir() == target
    assert len(conversions) == 0 and "used unchecked" in caplog.text
    assert model_files.resolve_model_dir() == target and len(conversions) == 1  # writable again: converted
    (target / "model.safetensors").write_bytes(b"")
    with _unwritable(target.parent), pytest.raises(OSError):
        model_files.resolve_model_dir()
