"""How the disk tier of a spill store (``spill_disk.DiskTier``) treats a fault of one of its
files: which faults are retried, which take a file out of service, which leave it unindexed.
``DiskTier`` keeps the index and decides what a fault does to it (a block or a file dropped
from it, a read that misses); the files it does not serve are kept, counted and deleted by
``spill_unserved.UnservedFiles``.

A fault of a file as a whole (header, length, format: ``SpillCorruptError``) takes it out of
service: it is moved into the quarantine folder (``UnservedFiles.quarantine``), as is a file
left with no block after blocks failed their checksums (``SpillBlocksCorrupt``, dropped block
by block by ``DiskTier``). Any other ``OSError`` (EIO, EMFILE, EACCES, ENOSPC...) is
transient: it is retried ``READ_ATTEMPTS`` times with a short backoff (``io_retries``), then
it is the caller's to count (``io_errors``): a read is a miss, the file staying on disk and
in the index. At a restart a file whose header cannot be read stays on disk unindexed, and a
file of another format version or block format is skipped (``skipped_files``): left on disk,
never indexed; both count against the disk budget as unindexed files
(``UnservedFiles.add_unindexed``). A file that vanished since the listing, or a name that
is no regular file (``spill_format.NotRegularFile``: never opened), is passed over. Files are
named in the tier's directory descriptor (``UnservedFiles.spill_dir``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from cache_node.tiers import spill_format as fmt
from cache_node.tiers.spill_format import (
    BlockFormat,
    GroupHeader,
    SpillCorruptError,
    SpillFormatMismatch,
)
from cache_node.tiers.spill_unserved import UnservedFiles

logger = logging.getLogger(__name__)

READ_ATTEMPTS = 3  # tries of one file read or header read before a transient OSError is a miss
RETRY_BACKOFF_S = 0.005  # sleep before retry k (k = 1, 2, ...): RETRY_BACKOFF_S * 2**(k - 1)
_T = TypeVar("_T")


class DiskFaults:
    """The fault handling of one ``DiskTier``'s files.

    Args:
        block_format: the tier's block format (a file of another is skipped at a restart).
        unserved: the files the tier does not serve: quarantined and unindexed files go there.
        counters: the tier's shared fault counters (``corrupt_reads``, ``quarantined_files``,
            ``io_retries``, ``io_errors``, ``skipped_files``).
    """

    def __init__(self, block_format: BlockFormat, unserved: UnservedFiles, counters: Counter[str]) -> None:
        self.block_format = block_format
        self.unserved = unserved
        self._counters = counters

    def retry(self, call: Callable[[], _T]) -> _T:
        """``call()``, retried on a transient OSError (not ENOENT) up to ``READ_ATTEMPTS`` times."""
        for attempt in range(1, READ_ATTEMPTS + 1):
            try:
                return call()
            except FileNotFoundError:
                raise
            except OSError:
                if attempt == READ_ATTEMPTS:
                    raise
                self._counters["io_retries"] += 1
                time.sleep(RETRY_BACKOFF_S * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def read_index_header(self, name: str) -> GroupHeader | None:
        """The header of group file ``name`` when the file can be indexed; else None, the file
        quarantined, counted as unindexed, or gone (or no regular file)."""
        path = self.unserved.root_dir / name
        try:
            header = self.retry(lambda: fmt.read_header(name, self.unserved.spill_dir.fd))
        except SpillCorruptError as exc:
            self.quarantine(name, exc)
            return None
        except SpillFormatMismatch as exc:
            logger.warning("skipping spill file %s: %s", path, exc)
            self._counters["skipped_files"] += 1
            self.unserved.add_unindexed(name)
            return None
        except FileNotFoundError:
            return None  # vanished since the listing, or no regular file now
        except OSError as exc:
            logger.warning("spill file %s not indexed (left on disk for the next restart, "
                           "deleted first when the disk budget needs room): %s", path, exc)
            self._counters["io_errors"] += 1
            self.unserved.add_unindexed(name)
            return None
        if not header.matches(self.block_format):
            logger.warning("skipping spill file %s of another block format", path)
            self._counters["skipped_files"] += 1
            self.unserved.add_unindexed(name)
            return None
        return header

    def quarantine(self, name: str, exc: SpillCorruptError) -> None:
        """Count a verified corruption and move the file aside (``set_aside``)."""
        logger.warning("spill file %s is corrupt, quarantined: %s", self.unserved.root_dir / name, exc)
        self._counters["corrupt_reads"] += 1
        self.set_aside(name)

    def set_aside(self, name: str) -> None:
        """Move a corrupt file into the quarantine folder (``UnservedFiles.quarantine``)."""
        if self.unserved.quarantine(name):
            self._counters["quarantined_files"] += 1
