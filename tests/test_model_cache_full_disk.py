"""A checkpoint conversion that fills the model cache's disk (``save_checkpoint``) leaves none of
its partial files behind: the disk has its room back at once, and the conversion succeeds once
the disk has room.

Regression (s40 diskfull): the temp directory of a save cut short by ENOSPC stayed, holding
the partial weights (up to the size of the model) on the full disk, until the next conversion
of that same checkpoint removed it: every other writer of that disk (spill tier, tenant store,
reports) stayed without room meanwhile.

A real tiny Llama and tokenizer saved (``save_pretrained``) onto a real 256 KiB tmpfs (root
only), then the same tmpfs grown (``remount``).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from cache_node.model_files import ensure_checkpoint, incomplete_reason, save_checkpoint
from cache_node.model_loader import tiny_llama
from tests.tiny_disk import tiny_disk  # noqa: F401 - the fixture


def _build(target: Path) -> Path:
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    return save_checkpoint(target, tiny_llama(seed=1).model, PreTrainedTokenizerFast(tokenizer_object=tokenizer))


def _free(root: Path) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def test_a_conversion_that_fills_the_disk_leaves_no_partial_files(tiny_disk: Path) -> None:  # noqa: F811
    target = tiny_disk / "models" / "tiny"
    target.parent.mkdir()
    free = _free(tiny_disk)

    with pytest.raises(Exception, match="No space left on device"):  # safetensors' own error type
        _build(target)

    assert sorted(p.name for p in target.parent.iterdir()) == []  # no temp directory, no target
    assert _free(tiny_disk) == free  # its room back
    subprocess.run(["mount", "-o", "remount,size=16m", str(tiny_disk)], check=True)
    assert ensure_checkpoint(target, _build) == target and incomplete_reason(target) is None


@contextmanager
def _file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes of a file fail with EFBIG in this process meanwhile
    (``RLIMIT_FSIZE``, its ``SIGXFSZ`` ignored); no root needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_conversion_whose_weights_cannot_be_written_leaves_no_partial_files(tmp_path: Path) -> None:
    """The same as a full disk where no tmpfs can be mounted (not root: the test above is
    skipped there): the weights' write fails (EFBIG past a 128 KiB file size limit, safetensors'
    own error), no temp directory is left, and the conversion succeeds once writes pass again.
    (s40 diff review r7 of 06587b1: its only test needed root.)"""
    target = tmp_path / "models" / "tiny"
    target.parent.mkdir()

    with _file_size_limit(128 * 1024), pytest.raises(Exception, match="File too large"):
        _build(target)

    assert sorted(p.name for p in target.parent.iterdir()) == []  # no temp directory, no target
    assert ensure_checkpoint(target, _build) == target and incomplete_reason(target) is None
