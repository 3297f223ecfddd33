"""workload_keys.json under concurrent workloads (``workloads.deepresearch.register.save_keys``)."""

from __future__ import annotations

import json
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workloads.deepresearch.register import load_keys, save_keys


def test_concurrent_saves_lose_no_key(tmp_path: Path) -> None:
    """Regression (s38 durability audit): ``save_keys`` read the file, merged and wrote it back
    with no lock, so two workloads saving at once (two ``kvstrata run`` on one state dir) lost
    one's keys: its tenants then counted as someone else's and its next run stopped (exit 1)
    until a human removed them. Each save here is a separate open of the lock, as two
    processes' are."""
    path = tmp_path / "state" / "workload_keys.json"
    names = [(f"gw{w}", f"t{i}") for w in range(4) for i in range(12)]

    def save(worker: int) -> None:
        for deployment, name in names[worker::4]:
            save_keys(path, deployment, {name: f"key-{deployment}-{name}"})

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save, range(4)))
    saved = json.loads(path.read_text())
    assert sum(len(v) for v in saved.values()) == len(names)
    for deployment, name in names:
        assert load_keys(path, deployment)[name] == f"key-{deployment}-{name}"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
