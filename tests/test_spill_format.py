"""Group-file format of the spill tier: exact round trips and typed corruption errors."""

from __future__ import annotations

import hashlib
import os
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import xxhash

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
    with pytest.raises(SpillCorruptError, match=r"checksum mismatch in blocks \[3\]"):
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


def crafted(path: Path, header: bytes) -> Path:
    """A group file whose header is ``header`` under a valid prefix and digest (as one with
    write access to the private spill directory could make)."""
    path.write_bytes(b"KVSP" + struct.pack("<I", len(header)) + xxhash.xxh3_128_digest(header) + header)
    return path


def traced_peak(work: Any) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        work()
        raised = None
    except Exception as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return raised, peak


def test_a_crafted_header_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """Regression (review 25a G): a header of up to 64 MiB was unpacked with msgpack's default
    limits: a crafted 16 MiB one of empty maps cost 1.16 GiB at a spill node's start before it
    was found corrupt (64 MiB: ~4.6 GiB). Now a header is at most ``MAX_HEADER_BYTES`` (what
    ``write_group`` writes at its bounds) and is decoded within what it writes: the review's
    file is refused by its length, unread, and a nested one within the length (each array
    within ``MAX_BLOCKS_PER_FILE``) after 8 containers; each costs about its bytes."""
    n = (16 << 20) - 5
    big = crafted(tmp_path / "big.kvs", b"\xdd" + struct.pack(">I", n) + b"\x80" * n)
    raised, peak = traced_peak(lambda: read_header(big))
    assert isinstance(raised, SpillCorruptError) and "header length" in str(raised) and peak < 1 << 20
    width = spill_format.MAX_BLOCKS_PER_FILE
    nested = msgpack.packb([[{}] * width] * ((spill_format.MAX_HEADER_BYTES - 16) // (width + 3)))
    assert len(nested) <= spill_format.MAX_HEADER_BYTES
    path = crafted(tmp_path / "nested.kvs", nested)
    raised, peak = traced_peak(lambda: read_header(path))
    assert isinstance(raised, SpillCorruptError) and "malformed header" in str(raised)
    assert peak < 4 * len(nested)  # the file's bytes, read (the old decode: ~70 times them)
    for header in (msgpack.packb({"version": msgpack.ExtType(1, b"xx")}),  # no extension type
                   msgpack.packb({"namespace": "n" * (spill_format.MAX_LABEL_BYTES + 1)}),
                   msgpack.packb({f"k{i}": 0 for i in range(17)})):
        with pytest.raises(SpillCorruptError, match="malformed header"):
            read_header(crafted(tmp_path / "small.kvs", header))


def test_the_largest_header_write_group_writes_is_read_and_no_larger_one_is_written(tmp_path: Path) -> None:
    """The bounds hold every file a store writes: ``MAX_BLOCKS_PER_FILE`` blocks of
    ``MAX_FILE_TOKENS`` token ids in all, a namespace of ``MAX_LABEL_BYTES``, or one block of
    every token id, read back whole; one block, one token id or one byte more is refused by the
    writer (ValueError), never written to be quarantined."""
    fmt = BlockFormat(shape=(1,), dtype="int8", kv_format="k" * spill_format.MAX_LABEL_BYTES)
    per_block = spill_format.MAX_FILE_TOKENS // spill_format.MAX_BLOCKS_PER_FILE
    count = spill_format.MAX_BLOCKS_PER_FILE
    hashes = [block_hash(i) for i in range(count)]
    tokens = [spill_format.token_bytes(range(i, i + per_block)) for i in range(count)]
    blocks = np.zeros((count, 1), np.int8)
    namespace = "\U0001f600" * (spill_format.MAX_LABEL_BYTES // 4)
    path = tmp_path / "max.kvs"
    size = write_group(path, hashes, blocks, namespace, fmt, tokens)
    assert size - count > spill_format.MAX_HEADER_BYTES * 0.95
    header = read_header(path)
    assert header.block_tokens == tuple(tokens) and header.namespace == namespace
    write_group(path, hashes[:1], blocks[:1], "ns", fmt, [b"".join(tokens)])
    assert read_header(path).block_tokens == (b"".join(tokens),)
    for args, bound in (((hashes + [block_hash(-1)], np.zeros((count + 1, 1), np.int8), namespace, fmt,
                          tokens + [b""]), "blocks"),
                        ((hashes[:1], blocks[:1], "ns", fmt, [b"".join(tokens) + bytes(8)]), "token ids"),
                        ((hashes[:1], blocks[:1], namespace + "n", fmt, None), "namespace")):
        with pytest.raises(ValueError, match=bound):
            write_group(tmp_path / "over.kvs", *args)
    assert not (tmp_path / "over.kvs").exists()
