"""Review 31 F1: the writer's write sequence stays within the reader's bound
(``spill_format.MAX_SEQ``). A group file whose header held seq == MAX_SEQ (accepted as sound) made
every later write carry MAX_SEQ + 1, which the next restart rejected as corrupt, and so did a
clock past 2116: every block the node spilled after it was lost (quarantined) at each restart.
Of the same kind: ``write_group`` wrote headers the reader refuses (a hash that is not 32 bytes,
token bytes that are not whole int64 ids)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from cache_node.tiers import spill_disk, spill_format
from cache_node.tiers.spill_store import SpillStore
from tests.test_spill_disk_faults import tokens
from tests.test_spill_store import BLOCK, DISK, FMT, files_in, hashes_of, make_blocks


def test_writes_after_a_max_seq_header_survive_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "0"
    root.mkdir(mode=0o700)
    spill_format.write_group(root / "aa.kvs", hashes_of([100]), make_blocks([100]), "tenant:x", FMT,
                             seq=spill_format.MAX_SEQ)  # in bounds: indexed
    store = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:bob", tokens(range(4))) == 4
    assert None not in store.contains(hashes_of(range(4)))  # on disk now
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(4))) == ["spill_disk"] * 4, restarted.stats()
    assert restarted.contains(hashes_of([100])) == ["spill_disk"]
    assert restarted.stats()["quarantined_files"] == 0


def test_writes_under_a_clock_past_max_seq_survive_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer took ``time_ns()`` as a sequence without the reader's bound: a clock past 2116
    (an RTC glitch) wrote files that every restart then quarantined."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    monkeypatch.setattr(time, "time_ns", lambda: spill_format.MAX_SEQ + 10**9)
    assert store.put(hashes_of(range(4)), make_blocks(range(4)), "tenant:bob", tokens(range(4))) == 4
    monkeypatch.undo()
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    assert restarted.contains(hashes_of(range(4))) == ["spill_disk"] * 4, restarted.stats()


def test_after_a_clock_past_the_bound_a_block_written_again_still_wins_at_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ordering ``seq`` gives (a block's newest copy wins at a restart, review 30e F6) holds
    past the clock's reach: a block that failed its checksum in a file written under a clock past
    the bound, and was written again after the clock came back, is served from its new copy."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    with monkeypatch.context() as m:
        m.setattr(time, "time_ns", lambda: spill_format.MAX_SEQ + 10**9)
        store.put(hashes_of([0, 1]), make_blocks([0, 1]), "tenant:a", tokens([0, 1]))
    (old,) = files_in(tmp_path)
    data = bytearray(old.read_bytes())
    data[-BLOCK - 1] ^= 1  # block 0's payload
    old.write_bytes(bytes(data))
    assert store.get(hashes_of([0]), tokens([0])).hashes == []  # dropped as corrupt, 1 still served
    store.put(hashes_of([0]), make_blocks([0]), "tenant:a", tokens([0]))
    (new,) = set(files_in(tmp_path)) - {old}
    assert spill_format.read_header(old).seq < spill_format.read_header(new).seq <= spill_format.MAX_SEQ
    back = old.stat().st_mtime_ns - 3600 * 10**9
    os.utime(new, ns=(back, back))  # mtime would pick the corrupt copy
    store.close()  # a restart: the old process is gone, its lock with it
    restarted = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK)
    hits = restarted.get(hashes_of([0, 1]), tokens([0, 1]))
    assert hits.blocks.tobytes() == make_blocks([0, 1]).tobytes()
    assert restarted.stats()["corrupt_blocks"] == 0


def test_write_sequences_stay_rising_and_within_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the clock's reach the sequence counts on by one below ``MAX_SEQ``; from a file at
    the bound (crafted: no writer puts one there) it stays at the bound, never past it."""
    store = SpillStore(tmp_path, FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=1)
    monkeypatch.setattr(time, "time_ns", lambda: 2**63 - 1)
    store.put(hashes_of(range(3)), make_blocks(range(3)), "tenant:a", tokens(range(3)))
    seqs = sorted(spill_format.read_header(p).seq for p in files_in(tmp_path))
    assert seqs == [spill_disk.SEQ_CLOCK_MAX + k for k in range(3)]
    root = tmp_path / "at-bound"
    root.mkdir(mode=0o700)
    spill_format.write_group(root / "aa.kvs", hashes_of([100]), make_blocks([100]), "tenant:x", FMT,
                             seq=spill_format.MAX_SEQ)
    at_bound = SpillStore(root, FMT, ram_bytes=0, disk_bytes=DISK, max_blocks_per_file=1)
    assert at_bound.put(hashes_of(range(2)), make_blocks(range(2)), "tenant:a", tokens(range(2))) == 2
    assert {spill_format.read_header(p).seq for p in files_in(root)} == {spill_format.MAX_SEQ}


@pytest.mark.parametrize("seq", [-1, spill_format.MAX_SEQ + 1, 2**63 - 1, True])
def test_write_group_refuses_a_seq_the_reader_would_refuse(tmp_path: Path, seq: int) -> None:
    with pytest.raises(ValueError, match="seq"):
        spill_format.write_group(tmp_path / "x.kvs", hashes_of([0]), make_blocks([0]), "ns", FMT, seq=seq)
    assert not files_in(tmp_path)


@pytest.mark.parametrize(("hashes", "block_tokens", "match"), [
    ([b"\x01" * 31], None, "block hash"),
    ([32], None, "block hash"),  # bytes(32) would be a hash of 32 zero bytes
    (None, [b"\x01" * 12], "token bytes"),
])
def test_write_group_refuses_what_the_reader_would_quarantine(tmp_path: Path, hashes, block_tokens, match) -> None:
    """A header the reader refuses as corrupt is never written (the file was written, indexed,
    then quarantined with its blocks at the next restart)."""
    with pytest.raises(ValueError, match=match):
        spill_format.write_group(tmp_path / "x.kvs", hashes or hashes_of([0]), make_blocks([0]), "ns", FMT,
                                 block_tokens)
    assert not files_in(tmp_path)
