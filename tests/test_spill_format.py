"""Group-file format of the spill tier: exact round trips and typed corruption errors."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from cache_node.tiers import spill_format
from cache_node.tiers.spill_format import (
    BlockFormat,
    SpillCorruptError,
    list_group_files,
    read_blocks,
    read_header,
    write_group,
)

FMT = BlockFormat(shape=(2, 2, 4, 1, 2), dtype="float16", kv_format="fp16")  # 64 B/block


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def make_blocks(n: int, fmt: BlockFormat = FMT) -> np.ndarray:
    size = int(np.prod(fmt.shape))
    return (np.arange(n * size) % 251 - 120).astype(fmt.np_dtype).reshape(n, *fmt.shape)


def write_four(tmp_path: Path) -> tuple[Path, list[bytes], np.ndarray]:
    hashes, blocks = [block_hash(i) for i in range(4)], make_blocks(4)
    path = tmp_path / ("g" + spill_format.FILE_SUFFIX)
    write_group(path, hashes, blocks, "tenant-a", FMT)
    return path, hashes, blocks


def test_block_format_normalizes_and_sizes() -> None:
    fmt = BlockFormat(shape=[30, 2, 16, 3, 64], dtype=np.float16, kv_format="fp16")
    assert fmt.shape == (30, 2, 16, 3, 64)
    assert fmt.dtype == "float16"
    assert fmt.block_nbytes == 30 * 2 * 16 * 3 * 64 * 2


@pytest.mark.parametrize(
    ("shape", "dtype", "kv_format"),
    [((), "float16", "fp16"), ((2, 0), "float16", "fp16"), ((2,), "object", "x"), ((2,), "f2", "")],
)
def test_block_format_rejects_bad_values(shape: tuple, dtype: str, kv_format: str) -> None:
    with pytest.raises(ValueError, match="BlockFormat"):
        BlockFormat(shape=shape, dtype=dtype, kv_format=kv_format)


def test_header_records_every_field(tmp_path: Path) -> None:
    path, hashes, _ = write_four(tmp_path)
    header = read_header(path)
    assert header.version == spill_format.FORMAT_VERSION
    assert header.block_hashes == tuple(hashes)
    assert (header.namespace, header.shape, header.dtype) == ("tenant-a", FMT.shape, "<f2")
    assert (header.kv_format, header.payload_bytes) == ("fp16", 4 * 64)
    assert len(header.block_checksums) == 4
    assert path.stat().st_size == header.file_bytes == header.payload_offset + 256


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_round_trip_is_byte_exact_per_dtype(tmp_path: Path, dtype: str) -> None:
    fmt = BlockFormat(shape=(3, 5), dtype=dtype, kv_format="test")
    hashes, blocks = [block_hash(i) for i in range(3)], make_blocks(3, fmt)
    path = tmp_path / "x.kvs"
    write_group(path, hashes, blocks, "ns", fmt)
    got = read_blocks(path, fmt, hashes)
    assert got.dtype == np.dtype(dtype)
    assert got.tobytes() == blocks.tobytes()


def test_subset_read_returns_rows_in_request_order(tmp_path: Path) -> None:
    path, hashes, blocks = write_four(tmp_path)
    got = read_blocks(path, FMT, [hashes[3], hashes[1], hashes[3]])
    assert got.tobytes() == blocks[[3, 1, 3]].tobytes()


def test_write_leaves_no_temp_file(tmp_path: Path) -> None:
    write_four(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["g.kvs"]


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault: fsync fails mid-write; neither a temp file nor a final file may remain."""

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="No space"):
        write_four(tmp_path)
    assert os.listdir(tmp_path) == []


def test_write_rejects_mismatched_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="do not match"):
        write_group(tmp_path / "x.kvs", [block_hash(0)], make_blocks(2), "ns", FMT)


class _ShortReads:
    """An unbuffered file whose every read returns at most 7 bytes, as a read past 2 GiB - 4 KiB
    does on Linux (one ``read`` never returns more)."""

    def __init__(self, f) -> None:  # type: ignore[no-untyped-def]
        self.f = f

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def readinto(self, view) -> int:  # type: ignore[no-untyped-def]
        return self.f.readinto(memoryview(view)[:7])

    def read(self, n: int) -> bytes:
        return self.f.read(min(n, 7))

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.f, name)


def test_short_reads_are_read_on_not_taken_for_truncation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 23a, F1): one ``readinto`` of a run of blocks returning fewer bytes
    than asked was taken for a truncated file, so any run over 2 GiB (Linux's most per read)
    of a sound file raised SpillCorruptError and the store quarantined the file. Reads go on
    until the run is whole; a real truncation is still refused."""
    path, hashes, blocks = write_four(tmp_path)
    real_open = open
    monkeypatch.setattr(spill_format, "open", lambda *a, **k: _ShortReads(real_open(*a, **k)), raising=False)
    assert read_header(path).block_hashes == tuple(hashes)
    assert read_blocks(path, FMT, hashes).tobytes() == blocks.tobytes()
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(SpillCorruptError):
        read_blocks(path, FMT, hashes)


def test_truncated_file_raises_corrupt(tmp_path: Path) -> None:
    """Fault: a file cut short (crash, full disk) must not be read as blocks."""
    path, hashes, _ = write_four(tmp_path)
    os.truncate(path, path.stat().st_size - 1)
    with pytest.raises(SpillCorruptError, match="header says"):
        read_blocks(path, FMT, hashes[:1])


def test_flipped_payload_byte_raises_corrupt(tmp_path: Path) -> None:
    """Fault: bit rot in a block's payload is caught by that block's checksum."""
    path, hashes, blocks = write_four(tmp_path)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # last byte of block 3
    path.write_bytes(bytes(data))
    with pytest.raises(SpillCorruptError, match="checksum mismatch in block 3"):
        read_blocks(path, FMT, hashes[3:])
    assert read_blocks(path, FMT, hashes[:1]).tobytes() == blocks[:1].tobytes()


def test_header_garbage_raises_corrupt(tmp_path: Path) -> None:
    """Fault: garbage over the header is caught by the header digest."""
    path, _, _ = write_four(tmp_path)
    data = bytearray(path.read_bytes())
    data[30:40] = b"\x00" * 10
    path.write_bytes(bytes(data))
    with pytest.raises(SpillCorruptError, match="digest mismatch"):
        read_header(path)


def test_bad_magic_raises_corrupt(tmp_path: Path) -> None:
    """Fault: a file that is not a spill group file at all."""
    path = tmp_path / "junk.kvs"
    path.write_bytes(b"not a spill file, just text long enough")
    with pytest.raises(SpillCorruptError, match="bad magic"):
        read_header(path)


def test_hash_not_in_file_raises_corrupt(tmp_path: Path) -> None:
    """Fault: a stale index entry pointing at the wrong file must not return its bytes."""
    path, _, _ = write_four(tmp_path)
    with pytest.raises(SpillCorruptError, match="not in file"):
        read_blocks(path, FMT, [block_hash(99)])


def test_other_block_format_raises_corrupt(tmp_path: Path) -> None:
    path, hashes, _ = write_four(tmp_path)
    other = BlockFormat(shape=FMT.shape, dtype="float16", kv_format="int8-scaled")
    with pytest.raises(SpillCorruptError, match="format"):
        read_blocks(path, other, hashes[:1])


def test_list_group_files_is_oldest_first_and_drops_temp_files(tmp_path: Path) -> None:
    for i, name in enumerate(["b.kvs", "a.kvs", "c.kvs"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, ns=(10**18 + i, 10**18 + i))
    (tmp_path / ".tmp-1.part").write_bytes(b"half")
    assert [p.name for p in list_group_files(tmp_path)] == ["b.kvs", "a.kvs", "c.kvs"]
    assert not (tmp_path / ".tmp-1.part").exists()
