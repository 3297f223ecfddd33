"""On-disk format of the spill tier: group files of many KV blocks, checksummed.

A group file holds one demotion batch (up to the store's ``max_blocks_per_file``),
so a 2k-token prefix with ``block_size`` 16 (128 blocks) is a few files. Layout::

    offset 0   magic  b"KVSP"                       4 bytes
    offset 4   header_len (uint32)                   4 bytes
    offset 8   xxh3_128 digest of the header bytes  16 bytes
    offset 24  header: msgpack map                   header_len bytes
    then       payload: raw block bytes, C order    num_blocks * block_nbytes bytes

Header keys: ``version``, ``block_hashes`` (32-byte each), ``block_tokens``
(each block's token ids as little-endian int64 bytes; empty when unknown),
``namespace``, ``shape`` (one block's), ``dtype`` (numpy ``dtype.str``, e.g. ``"<f2"``),
``kv_format``, ``payload_bytes``, ``checksum`` (algorithm),
``block_checksums`` (one xxh3_128 digest per block, so a subset of blocks is
read and verified without reading the whole payload) and ``seq`` (the writer's write
sequence: ``DiskTier`` keeps it rising across restarts and wall-clock steps, and a restart
indexes a block from the file of the highest ``seq`` holding it; a header without one, from
before it was written, counts as 0).

Versions: 2 added ``block_tokens`` (and came with block keys whose model identity is a
digest of the weights). A file of another version raises ``SpillFormatMismatch``: it is not
corrupt, only not ours, so a store skips it (left on disk, never indexed, counted against
the disk budget and deleted first when that needs room, or by a ``flush``) exactly like a file
of another block format. Writes go to a temp file
in the same directory, fsync, then ``os.replace``. Every read verifies the
header digest, the file length and each returned block's checksum; any fault
raises ``SpillCorruptError``. A block whose checksum fails, in a file whose header verified,
raises its subclass ``SpillBlocksCorrupt`` naming the bad blocks after every asked block was
read: the others are intact (each has its own checksum), so a store drops only those. A file
whose header, length or format is bad is moved aside into ``QUARANTINE_DIR`` for an operator
to inspect, within bounds (``spill_unserved``).

Only regular files are ever read: every open passes ``O_NOFOLLOW | O_NONBLOCK`` and the file
is ``fstat``-ed before a byte is read, so a FIFO, socket, device, directory or symbolic link
named like a group file raises ``NotRegularFile`` at once (a ``FileNotFoundError``: there is
no group file of that name), and ``list_group_names`` lists regular files only (no link is
followed). Each function takes an optional ``dir_fd``: the name is then resolved in that
directory descriptor (a ``DiskTier`` holds its directory open, so a directory swapped for a
link is never followed). Regression (review 30e F1): a FIFO named ``<x>.kvs`` blocked
``open()`` for good, in a restarted spill node's constructor (the whole spill tier down) or in
a ``get`` holding the store's lock (every tenant's put and get on that node hung).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np
import xxhash

from cache_node.msgpack_bounds import UnpackBounds, unpackb_within
from cache_node.tiers.runs import runs
from cache_node.tiers.spill_lock import lock_spill_dir

FORMAT_VERSION = 2
FILE_SUFFIX = ".kvs"
TEMP_PREFIX = ".tmp-"
HASH_BYTES = 32
CHECKSUM_ALGO = "xxh3_128"
CHECKSUM_BYTES = 16
MAX_BLOCKS_PER_FILE = 1024
"""Most blocks one group file holds (``write_group`` refuses more; a store writes at most its
``max_blocks_per_file``, 64 by default)."""
MAX_FILE_TOKENS = 1 << 20
"""Most token ids the blocks of one group file record together (``block_tokens``, 8 bytes each):
1,024 blocks of 1,024 tokens (a store's default file is 64 blocks of ``block_size`` 16)."""
MAX_LABEL_BYTES = 16 * 1024
"""Longest UTF-8 ``namespace``, ``kv_format`` or ``dtype`` a header records (a tenant's namespace
with a cache salt is far shorter)."""
MAX_SHAPE_DIMS = 64
"""Most dimensions of a block's shape a header records (5 in every store here)."""
MAX_HEADER_BYTES = (
    4096 + 3 * MAX_LABEL_BYTES  # the map, its keys, numbers, shape; namespace, kv_format, dtype
    + MAX_BLOCKS_PER_FILE * ((2 + HASH_BYTES) + (2 + CHECKSUM_BYTES) + 5)  # bin8, bin8, bin32 heads
    + 8 * MAX_FILE_TOKENS  # the token ids
)
"""Largest header ``write_group`` writes (8.1 MiB; 64 blocks of 16 tokens take ~12 KiB): one past it
is corrupt, read no further. Regression (review 25a G): the bound was 64 MiB, unpacked with
msgpack's default limits, so a crafted 16 MiB header (empty maps) cost 1.16 GiB at a spill node's
start before it was quarantined (64 MiB: ~4.6 GiB, past a small node's memory, into a restart
loop on the same file)."""
QUARANTINE_DIR = "quarantine"  # subfolder of the store's root holding corrupt files
TOMBSTONE_FILE = "dropped-holders.msgpack"
"""File in a spill directory listing the holders its store dropped for good
(``spill_disk.DiskTier.save_dropped``), each as the SHA-256 of its name (no tenant's name is left
on disk by its deletion)."""
FLUSH_FILE = "flushed-seq.msgpack"
"""File in a spill directory recording the write sequence of its store's last flush that may
have left group files behind (``spill_disk.DiskTier.flush``): a restart deletes every group file
whose header's ``seq`` is at most it, never indexes it."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""How a spill directory (or its quarantine folder) is opened: never through a link."""
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO does not wait for a writer (it is refused by the fstat next);
# on a regular file it changes nothing, so it is left set
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

MAX_SEQ = 1 << 62
"""Largest write sequence a header may hold (``time_ns`` reaches it in 2116), for the reader and
the writer alike: a file claiming more is corrupt, so that a restart never carries one forward,
and ``write_group`` refuses to write more (a programming error: ``DiskTier`` never asks it,
``spill_disk.SEQ_CLOCK_MAX``). Regression (review 30m F2): a header's seq of 2**63 - 1 was
taken as the largest found, and every later write on the node failed (ValueError out of
SpillStore.put, spill-RAM blocks dropped with it) for good. Regression (review 31 F1): the
writer wrote up to 2**63 - 1, so after a file at ``MAX_SEQ`` (or under a clock past 2116)
every write was ``MAX_SEQ + 1``, indexed, then quarantined as corrupt at the next restart."""

logger = logging.getLogger(__name__)

_BIG_ENDIAN_HOST = sys.byteorder == "big"
_MAGIC = b"KVSP"
_PREFIX = struct.Struct("<4sI16s")


class SpillCorruptError(Exception):
    """A spill file is truncated, has a bad header, or fails its checksum."""


class SpillBlocksCorrupt(SpillCorruptError):
    """Blocks of a file whose header verified failed their checksums; ``positions`` index the
    ``block_hashes`` asked of ``read_blocks``. Every other asked block was read and verified."""

    def __init__(self, message: str, positions: list[int]) -> None:
        super().__init__(message)
        self.positions = positions


class SpillFormatMismatch(Exception):
    """A spill file whose verified header has another format version than ``FORMAT_VERSION``."""


class NotRegularFile(FileNotFoundError):
    """A name that is no regular file (a FIFO, socket, device, directory or symbolic link): no
    group file by that name. Never opened for reading (``open_regular``)."""


def open_regular(path: str | os.PathLike[str], dir_fd: int | None = None) -> int:
    """A read-only descriptor of the regular file ``path`` (in ``dir_fd`` when given), opened
    without following a link and without waiting (``O_NONBLOCK``: a FIFO's open returns at
    once). Raises NotRegularFile for anything but a regular file, OSError when it cannot be
    opened."""
    try:
        fd = os.open(path, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link; a socket (or a FIFO on some systems)
            raise NotRegularFile(exc.errno, f"{path} is not a regular file") from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(errno.ENOENT, f"{path} is not a regular file (mode {stat.filemode(mode)})")
    return fd


@dataclass(frozen=True)
class BlockFormat:
    """The fixed payload format of every block in one spill store.

    ``shape``: one block's, e.g. ``(num_layers, 2, block_size, num_kv_heads, head_dim)``;
    ``dtype``: numpy name (``"float16"``, ``"int8"``, ...); ``kv_format``: label of
    the KV encoding (``"fp16"``, ``"int8-per-block-scale"``), kept in file headers.
    Raises ValueError for a non-positive shape, non-numeric dtype, empty kv_format.
    """

    shape: tuple[int, ...]
    dtype: str
    kv_format: str

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        if not shape or any(d <= 0 for d in shape):
            raise ValueError(f"BlockFormat.shape must be non-empty and positive, got {shape}")
        try:
            np_dtype = np.dtype(self.dtype)
        except TypeError as exc:
            raise ValueError(f"BlockFormat.dtype {self.dtype!r} is not a numpy dtype") from exc
        if np_dtype.kind not in "iuf":
            raise ValueError(f"BlockFormat.dtype must be int/uint/float, got {np_dtype}")
        if not self.kv_format:
            raise ValueError("BlockFormat.kv_format must be a non-empty string")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", np_dtype.name)

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype of a block, native byte order."""
        return np.dtype(self.dtype)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload."""
        return int(np.prod(self.shape)) * self.np_dtype.itemsize


@dataclass(frozen=True)
class GroupHeader:
    """A verified group file header; the payload starts at byte ``payload_offset``."""

    version: int
    block_hashes: tuple[bytes, ...]
    block_tokens: tuple[bytes, ...]  # token_bytes() of each block; b"" when unknown
    namespace: str
    shape: tuple[int, ...]
    dtype: str
    kv_format: str
    payload_bytes: int
    block_checksums: tuple[bytes, ...]
    payload_offset: int
    seq: int = 0  # the writer's write sequence (0: a file written before it was recorded)

    @property
    def file_bytes(self) -> int:
        """The exact file length this header implies."""
        return self.payload_offset + self.payload_bytes

    def matches(self, block_format: BlockFormat) -> bool:
        """True when the file's blocks have ``block_format``'s shape, dtype and kv_format."""
        return (
            self.shape == block_format.shape
            and self.dtype == block_format.np_dtype.newbyteorder("<").str
            and self.kv_format == block_format.kv_format
        )


def write_group(
    path: Path,
    block_hashes: Sequence[bytes],
    blocks: np.ndarray | Sequence[np.ndarray],
    namespace: str,
    block_format: BlockFormat,
    block_tokens: Sequence[bytes] | None = None,
    *,
    seq: int = 0,
    dir_fd: int | None = None,
) -> int:
    """Atomically write ``blocks`` as one group file at ``path``; returns its size in bytes.

    ``blocks``: ``(len(block_hashes), *block_format.shape)`` of ``block_format.dtype``, or one
    ``block_format.shape`` array per block (written one after the other, never stacked into
    one more copy); ``block_tokens``: each block's ``token_bytes`` (None: unknown);
    ``namespace`` and ``seq`` (the writer's write sequence, in [0, ``MAX_SEQ``]) are recorded in
    the header; with ``dir_fd``, ``path`` is a name in that directory descriptor. Raises
    ValueError for anything ``read_header`` would refuse as corrupt (blocks or tokens that do not
    match, a hash that is not ``HASH_BYTES`` bytes, token bytes that are not whole int64 ids, a
    ``seq`` out of its bound, a header past its bounds), OSError when the write, fsync or rename
    fails (no partial file is left).
    """
    if isinstance(blocks, np.ndarray) and (blocks.ndim != 1 + len(block_format.shape) or len(blocks) != len(block_hashes)):
        raise ValueError(f"blocks {blocks.shape} do not match {(len(block_hashes), *block_format.shape)}")
    if len(blocks) != len(block_hashes) or any(b.shape != block_format.shape or b.dtype != block_format.np_dtype
                                               for b in blocks):
        raise ValueError(f"blocks do not match {len(block_hashes)} x {block_format.shape}/{block_format.dtype}")
    tokens = [b""] * len(block_hashes) if block_tokens is None else [bytes(t) for t in block_tokens]
    if len(tokens) != len(block_hashes):
        raise ValueError(f"{len(tokens)} block_tokens for {len(block_hashes)} blocks")
    # what ``_check_header`` reads as sound, nothing else (review 31 F1: a file the reader
    # refuses is written, indexed, then quarantined with its blocks at the next restart)
    if any(not isinstance(h, (bytes, bytearray)) or len(h) != HASH_BYTES for h in block_hashes):
        raise ValueError(f"every block hash must be {HASH_BYTES} bytes")
    if any(len(t) % 8 for t in tokens):
        raise ValueError("every block's token bytes must be whole int64 ids (a multiple of 8 bytes)")
    _check_group_bounds(len(block_hashes), sum(map(len, tokens)), namespace, block_format)
    little = block_format.np_dtype.newbyteorder("<")
    rows = [np.ascontiguousarray(b, dtype=little).reshape(-1).view(np.uint8) for b in blocks]
    header = _pack_header(block_hashes, tokens, rows, little, namespace, block_format, seq)
    if len(header) > MAX_HEADER_BYTES:  # past the checks above: never, but never a file we refuse
        raise ValueError(f"a group file header of {len(header)} bytes: at most {MAX_HEADER_BYTES}")
    prefix = _PREFIX.pack(_MAGIC, len(header), xxhash.xxh3_128_digest(header))
    _atomic_write(Path(path), [prefix, header, *(row.data for row in rows)], dir_fd)
    return len(prefix) + len(header) + sum(row.nbytes for row in rows)


def _check_group_bounds(blocks: int, token_bytes: int, namespace: str, fmt: BlockFormat) -> None:
    """A group file of these fits what ``read_header`` reads (``MAX_HEADER_BYTES`` and the
    decoding limits, ``_unpack_header``). Raises ValueError naming the bound."""
    if blocks > MAX_BLOCKS_PER_FILE:
        raise ValueError(f"{blocks} blocks in one group file: at most {MAX_BLOCKS_PER_FILE}")
    if token_bytes > 8 * MAX_FILE_TOKENS:
        raise ValueError(f"{token_bytes // 8} token ids in one group file: at most {MAX_FILE_TOKENS}")
    for name, label in (("namespace", namespace), ("kv_format", fmt.kv_format)):
        if len(label.encode()) > MAX_LABEL_BYTES:
            raise ValueError(f"a {name} of {len(label.encode())} bytes: at most {MAX_LABEL_BYTES}")
    if len(fmt.shape) > MAX_SHAPE_DIMS:
        raise ValueError(f"a block shape of {len(fmt.shape)} dimensions: at most {MAX_SHAPE_DIMS}")


def read_header(path: str | os.PathLike[str], dir_fd: int | None = None) -> GroupHeader:
    """Read and verify a group file's header: magic, digest, fields, exact file length
    (``path`` in ``dir_fd`` when given).

    Raises SpillCorruptError for a truncated file or a bad/malformed header,
    SpillFormatMismatch for a file of another format version, NotRegularFile when ``path`` is
    no regular file (``open_regular``), and OSError when the file cannot be opened or read
    (e.g. it is missing).
    """
    with _open_read(path, dir_fd) as f:
        return _read_header(f, path)


def read_blocks(
    path: str | os.PathLike[str], block_format: BlockFormat, block_hashes: Sequence[bytes], out: np.ndarray | None = None,
    dir_fd: int | None = None,
) -> np.ndarray:
    """Read and verify the blocks ``block_hashes`` of one group file.

    Returns ``(len(block_hashes), *block_format.shape)``, row i = ``block_hashes[i]``
    (written into ``out`` when given, which must have that shape and the format's dtype).
    Blocks stored next to each other in the file are read with one ``readinto``.
    Raises SpillBlocksCorrupt (after reading every block: the rows not named in its
    ``positions`` are verified) when blocks fail their checksums, SpillCorruptError for a bad
    header, truncation, another block format or a hash not in the file; NotRegularFile when
    ``path`` (in ``dir_fd`` when given) is no regular file; OSError when it cannot be read.
    """
    if out is None:
        out = np.empty((len(block_hashes), *block_format.shape), dtype=block_format.np_dtype)
    with _open_read(path, dir_fd) as f:
        header = _read_header(f, path)
        if not header.matches(block_format):
            raise SpillCorruptError(f"{path}: format {header.shape}/{header.dtype} != store's")
        position = {h: i for i, h in enumerate(header.block_hashes)}
        for block_hash in block_hashes:
            if block_hash not in position:
                raise SpillCorruptError(f"{path}: block {block_hash.hex()} not in file")
        bad: list[int] = []
        for row, index, n in runs(range(len(block_hashes)), [position[h] for h in block_hashes]):
            bad += [row + k for k in _read_run(f, path, header, index, out[row : row + n], block_format)]
    if bad:
        blocks = sorted(position[block_hashes[k]] for k in bad)
        raise SpillBlocksCorrupt(f"{path}: checksum mismatch in blocks {blocks}", sorted(bad))
    return out


def _open_read(path: str | os.PathLike[str], dir_fd: int | None) -> Any:
    """``path`` (in ``dir_fd`` when given) opened unbuffered for reading by ``open_regular``."""
    return open(path, "rb", buffering=0, opener=lambda name, _flags: open_regular(name, dir_fd))


def _read_run(
    f: Any, path: str | os.PathLike[str], header: GroupHeader, index: int, out: np.ndarray, fmt: BlockFormat
) -> list[int]:
    """Read blocks ``index..index + len(out) - 1`` into ``out``; returns the offsets k (in
    ``out``) of those whose checksum fails. Raises SpillCorruptError when the file ends early."""
    f.seek(header.payload_offset + index * fmt.block_nbytes)
    view = out.view(np.uint8).reshape(-1).data
    if _read_fully(f, view) != len(view):
        raise SpillCorruptError(f"{path}: truncated in blocks {index}..{index + len(out) - 1}")
    bad = [k for k in range(len(out))
           if xxhash.xxh3_128_digest(view[k * fmt.block_nbytes : (k + 1) * fmt.block_nbytes])
           != header.block_checksums[index + k]]
    if _BIG_ENDIAN_HOST:
        out.byteswap(inplace=True)  # the payload is little-endian on every host
    return bad


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """The canonical bytes of one block's token ids (little-endian int64), as stored."""
    return np.asarray(token_ids, dtype=np.int64).astype("<i8").tobytes()


def _pack_header(
    block_hashes: Sequence[bytes],
    block_tokens: list[bytes],
    rows: list[np.ndarray],
    dtype: np.dtype,
    namespace: str,
    fmt: BlockFormat,
    seq: int,
) -> bytes:
    """The header of a group file of ``rows`` (each block's little-endian bytes, uint8)."""
    if type(seq) is not int or not 0 <= seq <= MAX_SEQ:  # the bound ``_check_header`` reads with
        raise ValueError(f"seq must be an int in [0, MAX_SEQ = {MAX_SEQ}], got {seq!r}")
    return msgpack.packb(
        {
            "version": FORMAT_VERSION,
            "block_hashes": [bytes(h) for h in block_hashes],
            "block_tokens": block_tokens,
            "namespace": namespace,
            "shape": list(fmt.shape),
            "dtype": dtype.str,
            "kv_format": fmt.kv_format,
            "payload_bytes": sum(row.nbytes for row in rows),
            "checksum": CHECKSUM_ALGO,
            "block_checksums": [xxhash.xxh3_128_digest(row.data) for row in rows],
            "seq": seq,
        },
        use_bin_type=True,
    )


def _read_fully(f: Any, view: memoryview) -> int:
    """Read from unbuffered ``f`` into ``view`` until it is full or the file ends; the bytes
    read. One ``readinto`` may return fewer bytes than asked without the file ending (Linux
    returns at most 2 GiB - 4 KiB per read): only a read of 0 bytes is the end.

    Regression (review 23a, F1): a run of blocks over 2 GiB (40 MiB blocks of a 70B-shaped pool,
    52 in a row) always came back short, so a sound group file was reported corrupt,
    quarantined and its blocks dropped."""
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            break
        done += n
    return done


def _read_exact(f: Any, n: int) -> bytes:
    """``n`` bytes from unbuffered ``f`` (fewer only where the file ends: ``_read_fully``)."""
    buf = bytearray(n)
    return bytes(buf[: _read_fully(f, memoryview(buf))])


def read_namespace(path: str | os.PathLike[str], dir_fd: int | None = None) -> str | None:
    """The ``namespace`` that ``path``'s header records (``path`` in ``dir_fd`` when given), when
    ``path`` is a regular file (a link is not followed) whose header digest verifies, whatever
    its format version, block format or payload (a file a store does not serve: unindexed or
    quarantined); None when it cannot be opened or read, or its header is corrupt or records no
    namespace."""
    try:
        f = _open_read(path, dir_fd)
    except OSError:
        return None
    try:
        with f:
            raw = _read_raw_header(f, path)
        fields = _unpack_header(raw)
    except Exception:  # noqa: BLE001 - unreadable, or any decode fault of untrusted bytes
        return None
    namespace = fields.get("namespace") if isinstance(fields, dict) else None
    return namespace if isinstance(namespace, str) else None


def _read_raw_header(f: Any, path: str | os.PathLike[str]) -> bytes:
    """The header bytes after the prefix, their digest verified. Raises SpillCorruptError."""
    prefix = _read_exact(f, _PREFIX.size)
    if len(prefix) != _PREFIX.size:
        raise SpillCorruptError(f"{path}: truncated before the header")
    magic, header_len, digest = _PREFIX.unpack(prefix)
    if magic != _MAGIC or header_len > MAX_HEADER_BYTES:
        raise SpillCorruptError(f"{path}: bad magic or header length {header_len}")
    raw = _read_exact(f, header_len)
    if len(raw) != header_len or xxhash.xxh3_128_digest(raw) != digest:
        raise SpillCorruptError(f"{path}: header truncated or digest mismatch")
    return raw


def _read_header(f: Any, path: str | os.PathLike[str]) -> GroupHeader:
    raw = _read_raw_header(f, path)
    header = _decode_header(raw, _PREFIX.size + len(raw), path)
    size_bytes = os.fstat(f.fileno()).st_size
    if size_bytes != header.file_bytes:
        raise SpillCorruptError(f"{path}: {size_bytes} bytes, header says {header.file_bytes}")
    return header


HEADER_BOUNDS = UnpackBounds(
    max_array_len=MAX_BLOCKS_PER_FILE, max_map_len=16, max_str_len=MAX_LABEL_BYTES,
    max_bin_len=8 * MAX_FILE_TOKENS, max_containers=8,  # the map, its 3 block lists, the shape
    max_elements=3 * MAX_BLOCKS_PER_FILE + MAX_SHAPE_DIMS + 64,
)
"""What ``write_group`` writes in a header (``_unpack_header``)."""


def _unpack_header(raw: bytes) -> Any:
    """``raw`` decoded within what ``write_group`` writes: each array at most
    ``MAX_BLOCKS_PER_FILE`` long, a map 16 entries, a string ``MAX_LABEL_BYTES``, a binary at
    most ``MAX_FILE_TOKENS`` token ids, no extension type, and 8 arrays and maps in all
    (``HEADER_BOUNDS``): a header never costs much more than its bytes. Raises ValueError past
    a bound."""
    return unpackb_within(raw, HEADER_BOUNDS, "a header")


def _decode_header(raw: bytes, payload_offset: int, path: str | os.PathLike[str]) -> GroupHeader:
    try:
        fields = _unpack_header(raw)
        if fields["version"] != FORMAT_VERSION:
            raise SpillFormatMismatch(f"{path}: version {fields['version']!r}, not {FORMAT_VERSION}")
        header = GroupHeader(
            version=int(fields["version"]),
            block_hashes=tuple(fields["block_hashes"]),
            block_tokens=tuple(fields["block_tokens"]),
            namespace=str(fields["namespace"]),
            shape=tuple(int(d) for d in fields["shape"]),
            dtype=str(fields["dtype"]),
            kv_format=str(fields["kv_format"]),
            payload_bytes=int(fields["payload_bytes"]),
            block_checksums=tuple(fields["block_checksums"]),
            payload_offset=payload_offset,
            seq=fields.get("seq", 0),
        )
        _check_header(header, fields["checksum"], path)
    except (SpillCorruptError, SpillFormatMismatch):
        raise
    except Exception as exc:  # any decode/type fault of untrusted bytes is corruption
        raise SpillCorruptError(f"{path}: malformed header ({exc})") from exc
    return header


def _check_header(header: GroupHeader, algo: object, path: str | os.PathLike[str]) -> None:
    if algo != CHECKSUM_ALGO:
        raise SpillCorruptError(f"{path}: checksum algorithm {algo!r} not supported")
    if type(header.seq) is not int or not 0 <= header.seq <= MAX_SEQ:
        raise SpillCorruptError(f"{path}: seq {header.seq!r} is not an int in [0, {MAX_SEQ}]")
    n = len(header.block_hashes)
    kinds = {(type(h), len(h)) for h in header.block_hashes}
    if len(header.block_checksums) != n or kinds - {(bytes, HASH_BYTES)}:
        raise SpillCorruptError(f"{path}: block hash/checksum lists are malformed")
    if len(header.block_tokens) != n or any(
        not isinstance(t, bytes) or len(t) % 8 for t in header.block_tokens
    ):
        raise SpillCorruptError(f"{path}: block token lists are malformed")
    block_bytes = int(np.prod(header.shape)) * np.dtype(header.dtype).itemsize
    if header.payload_bytes != n * block_bytes:
        raise SpillCorruptError(f"{path}: payload_bytes does not match shape and dtype")


def _atomic_write(path: Path, chunks: Sequence[bytes | memoryview], dir_fd: int | None) -> None:
    """Write ``chunks`` to a temp file (mode 0600, never through a link) in ``path``'s directory
    (``dir_fd`` when given, ``path`` then a name in it), fsync, rename over ``path``, fsync the
    directory."""
    if dir_fd is None:
        parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _atomic_write(Path(path.name), chunks, parent)
        finally:
            os.close(parent)
        return
    temp_name = f"{TEMP_PREFIX}{uuid.uuid4().hex}.part"
    fd = os.open(temp_name, _CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp_name, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_at(dir_fd, temp_name)  # a failing unlink must not hide the write's error
        raise
    try:
        os.fsync(dir_fd)
    except OSError as exc:  # the file is complete and renamed; only its entry's durability is unsure
        logger.warning("fsync of the spill directory after writing %s failed: %s", path, exc)


def write_small_file(path: str | os.PathLike[str], data: bytes, dir_fd: int | None = None) -> None:
    """Atomically write ``data`` as ``path`` (a name in ``dir_fd`` when given): a temp file
    (created, never through a link), fsync, rename over ``path`` (whatever it was: a link or
    FIFO there is replaced, never opened). Raises OSError (no partial file is left)."""
    _atomic_write(Path(path), [data], dir_fd)


class GroupName(NamedTuple):
    """A group file's name in a spill directory; ``link``: a symbolic link named like one."""

    name: str
    mtime_ns: int
    link: bool = False


def list_group_names(dir_fd: int, links: bool = False) -> list[GroupName]:
    """The regular group files in ``dir_fd``, oldest mtime first (with ``links``, the symbolic
    links named like one too, never followed: a store counts them as unindexed and deletes the
    link, never its target); a FIFO, device or directory named like one is left out. Deletes
    the temp files of unfinished writes (regular files or links: the names, never a link's
    target). Raises OSError when the directory cannot be listed."""
    found: list[GroupName] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.name.startswith(TEMP_PREFIX):
                if entry.is_symlink() or entry.is_file(follow_symlinks=False):
                    unlink_at(dir_fd, entry.name)
                continue
            if not entry.name.endswith(FILE_SUFFIX):
                continue
            link = entry.is_symlink()
            if (link and links) or entry.is_file(follow_symlinks=False):
                try:
                    found.append(GroupName(entry.name, entry.stat(follow_symlinks=False).st_mtime_ns, link))
                except FileNotFoundError:  # vanished while listing
                    continue
    return sorted(found, key=lambda g: (g.mtime_ns, g.name))


def list_group_files(root_dir: Path) -> list[Path]:
    """Regular group files in ``root_dir``, oldest mtime first; deletes temp files of unfinished
    writes (``list_group_names``)."""
    fd = os.open(root_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return [root_dir / g.name for g in list_group_names(fd)]
    finally:
        os.close(fd)


def unlink_at(dir_fd: int, name: str) -> OSError | None:
    """Unlink ``name`` in ``dir_fd`` (the name itself: a link goes, never its target); returns
    the error when it could not be deleted (None when done or already gone)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return exc
    return None


class UnsafeSpillDir(OSError):
    """A spill directory that cannot be used safely: a link, not a directory, or one another
    user could change."""


class SpillDir:
    """A spill directory held open by a descriptor (``DIR_FLAGS``: never through a link) from
    construction on: a ``DiskTier`` resolves every name in it (``dir_fd``), so a directory
    renamed or swapped for a link while a node runs is never followed, and ``flush`` deletes
    only names in the directory it opened.

    ``reopen`` (after the directory was deleted: ``gone``) makes it again with mode 0700 and
    opens the new one, refusing a link, a non-directory, one of another user or one its group
    or others may write (``UnsafeSpillDir``). Regression (review 30e F4): every operation went
    through ``root_dir / name``, so a directory deleted while running failed every later write
    until a restart, and one swapped for a link had the writes land in the link's target and
    ``flush`` delete every ``*.kvs`` there.

    The directory is locked (``spill_lock``: an exclusive ``flock`` on its ``LOCK_FILE``) from
    construction until ``close``, so no two stores use one directory at once (review s35 D
    S2); ``reopen`` locks the new directory. After ``close`` the directory is neither used nor
    made again (``reopen`` raises).

    Args:
        path: the directory (made with mode 0700, and its missing parents, when missing).
        lock_wait_s: how long construction waits while another store holds the lock (0: it
            fails at once).
        lock_owner: who holds the lock, written into its file for the next opener
            (``spill_lock.lock_spill_dir``'s ``owner``).

    Raises (construction): UnsafeSpillDir when ``path`` is a link or not a directory;
    ``spill_lock.SpillDirLocked`` when another store holds its lock past ``lock_wait_s``;
    OSError when it cannot be made or opened, or its lock file is not a regular file.
    """

    def __init__(self, path: Path, lock_wait_s: float = 0.0, lock_owner: str = "") -> None:
        self.path = Path(path)
        self.lock_owner = lock_owner
        self.closed = False
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = self._open(check_private=False)  # the node checked it (services.private_dir)
        try:
            self.lock_fd = lock_spill_dir(self.fd, self.path, lock_wait_s, lock_owner)
        except BaseException:
            os.close(self.fd)
            raise

    def gone(self) -> bool:
        """Whether the directory held was deleted (no name links to it any more)."""
        try:
            return os.fstat(self.fd).st_nlink == 0
        except OSError:
            return True

    def reopen(self) -> None:
        """Make ``path`` again (mode 0700, its missing parents too) if missing and hold the
        directory there now; the old descriptor is closed (a caller outside the owner's lock holds its own ``dup``). Raises
        UnsafeSpillDir or OSError as construction does, and for a directory another user could
        change, or when another store holds the new directory's lock (``SpillDirLocked``) or
        this one was closed; the old descriptor is kept then."""
        if self.closed:
            raise OSError(errno.EBADF, f"spill directory {self.path}: its store was closed")
        missing = []  # the spill root above it may have gone too (rm -rf <state_dir>/spill): review 30m F3
        for parent in (self.path, *self.path.parents):
            if os.path.lexists(parent):
                break
            missing.append(parent)
        for path in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        fd = self._open(check_private=True)
        try:
            lock_fd = lock_spill_dir(fd, self.path, owner=self.lock_owner)
        except BaseException:
            os.close(fd)
            raise
        os.close(self.fd)
        os.close(self.lock_fd)  # the deleted directory's lock: nobody can open that file any more
        self.fd, self.lock_fd = fd, lock_fd

    def dup(self) -> int:
        """A descriptor of the same directory that the caller closes."""
        return os.dup(self.fd)

    def _open(self, check_private: bool) -> int:
        try:
            fd = os.open(self.path, DIR_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeSpillDir(exc.errno, f"spill directory {self.path} is a link or not a directory: "
                                                "not used (name the directory itself)") from exc
            raise
        if check_private:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
                os.close(fd)
                raise UnsafeSpillDir(errno.EPERM, f"spill directory {self.path} is owned by uid {st.st_uid} "
                                                  f"or writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
        return fd

    def close(self) -> None:
        """Release the lock and the directory (idempotent); a later use fails (EBADF)."""
        if self.closed:
            return
        self.closed = True
        for fd in (self.lock_fd, self.fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fd = self.lock_fd = -1  # never a number reused by a later open
