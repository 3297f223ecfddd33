"""The KV tiers below the device pool, and the moves between them.

- ``manager``: ``TierManager`` and ``TierConfig``, demotion and promotion across tiers;
- ``engine_api``: the engine's tier calls (prefetch, demotion, flush, events), mixed into
  ``LLMEngine``;
- ``host``: the host tier, one pinned CPU tensor of blocks;
- ``block_copy`` and ``runs``: batched block copies, coalesced into runs of consecutive ids;
- ``device_copy``: on a CUDA pool, those copies async on a copy stream, ordered by events;
- ``prefetch``: the transfer worker (spill puts, prefetch gets) on a background thread;
- ``spill_api``: the engine's narrow view of the spill tier (``SpillClient``);
- ``spill_store``, ``spill_disk``, ``spill_disk_faults``, ``spill_unserved``, ``spill_format``:
  the spill storage engine (a RAM tier, disk group files, their faults, the files it does not
  serve, and their format), served by the ``SpillNode`` actor in ``services/``.

Nothing here imports Ray, gRPC or ``services``.
"""
