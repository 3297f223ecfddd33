"""bench.chaos_stack.tiny_checkpoint under concurrent first use (pytest-xdist workers, two
benches): a checkpoint one caller was handed is never removed under it by another's build.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import transformers

from bench.chaos_stack import TINY_NAME, tiny_checkpoint
from cache_node import model_files


def test_a_checkpoint_handed_out_is_not_removed_by_a_concurrent_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Regression (s38 review r6 of 7a86e0a): tiny_checkpoint removed a checkpoint that was
    not whole with no lock, after its build (seconds). Two callers found none; the first to
    build returned its checkpoint, and the other's build then removed the directory the first
    was loading and wrote its own: the first's test failed on vanished files. Here both check
    before either goes on, and a second build (if any) waits until the first caller returned."""
    monkeypatch.setenv("KVSTRATA_CACHE", str(tmp_path))
    both_checked = threading.Barrier(2, timeout=60)
    first_returned = threading.Event()
    checked: set[str] = set()
    builds: list[str] = []
    check, llama = model_files.incomplete_reason, transformers.LlamaForCausalLM

    def checking(path: Path) -> str | None:
        why = check(path)
        me = threading.current_thread().name
        if me not in checked:
            checked.add(me)
            both_checked.wait()
        return why

    def building(config: object) -> object:
        builds.append(threading.current_thread().name)
        if len(builds) > 1:
            assert first_returned.wait(60)
        return llama(config)

    monkeypatch.setattr(model_files, "incomplete_reason", checking)
    monkeypatch.setattr(transformers, "LlamaForCausalLM", building)
    returned: list[tuple[str, Path, int]] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            path = tiny_checkpoint()
            returned.append((threading.current_thread().name, path, (path / "model.safetensors").stat().st_ino))
            first_returned.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, name=name) for name in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    target = tmp_path / "models" / TINY_NAME
    assert [path for _, path, _ in returned] == [target, target]
    first_inode = returned[0][2]
    assert (target / "model.safetensors").stat().st_ino == first_inode, "the first caller's checkpoint was replaced under it"
    assert len(builds) == 1, builds
    assert check(target) is None
