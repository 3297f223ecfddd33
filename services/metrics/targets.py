"""Prometheus file-based service discovery for a running deployment.

``kvstrata up`` writes every actor's ``/metrics`` address to ``<state_dir>/prometheus_targets.json``
in Prometheus's ``file_sd_configs`` format (a list of ``{"targets": [...], "labels": {...}}``
groups); ``deploy/prometheus.yml`` reads it, and Prometheus rereads it when it changes.

The file is written atomically and durably (``kvstrata.durable_files.write_file_atomic``: temp file,
fsync, rename, directory fsync), mode 0644 so that a Prometheus of another user may read it.
Regression (s39): it was written to a fixed ``.tmp`` name and renamed without fsync, so a crash
(power loss) after ``up`` could leave an empty or cut-short file, a Prometheus (re)started on
it scraped nothing, and two ``up`` at once on one ``state_dir`` shared the temp file.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.durable_files import write_file_atomic

TARGETS_FILE = "prometheus_targets.json"


def role_of(actor_name: str) -> str:
    """The ``role`` label of an actor: "gateway", "cache_node" or "spill_node"."""
    return actor_name.rstrip("0123456789").rstrip("_") or actor_name


def write_targets(addresses: dict[str, str], path: Path, deployment: str) -> Path:
    """Write ``addresses`` (actor name -> ``host:port``) as one file_sd group per actor, with
    labels ``role``, ``actor`` and ``deployment`` (the Ray namespace); atomic and durable (a
    scraper never reads half a file, a crash leaves the old file or the new one). Returns
    ``path``.

    Raises:
        OSError: ``path``'s directory cannot be written."""
    groups = [{"targets": [address], "labels": {"role": role_of(name), "actor": name, "deployment": deployment}}
              for name, address in sorted(addresses.items())]
    write_file_atomic(path, json.dumps(groups, indent=2) + "\n", 0o644)
    return path
