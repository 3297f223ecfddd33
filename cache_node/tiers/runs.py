"""Run coalescing: paired ids grouped into runs where both advance by one.

One copy (or one read) per run instead of one per block: ``block_copy`` copies a run of
blocks with one strided ``copy_``, ``spill_format`` reads a run of rows with one ``readinto``.
Plain Python (no torch), so the spill storage engine can use it.
"""

from __future__ import annotations

from collections.abc import Sequence


def runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Coalesce paired ids into ``(src_start, dst_start, length)`` runs where both advance by 1
    (pairs are taken in source order: the copies are independent)."""
    out: list[tuple[int, int, int]] = []
    for s, d in sorted(zip(src_ids, dst_ids)):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            s0, d0, n = out[-1]
            out[-1] = (s0, d0, n + 1)
        else:
            out.append((s, d, 1))
    return out
