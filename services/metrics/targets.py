"""Prometheus file-based service discovery for a running deployment.

``kvstrata up`` writes every actor's ``/metrics`` address to ``<state_dir>/prometheus_targets.json``
in Prometheus's ``file_sd_configs`` format (a list of ``{"targets": [...], "labels": {...}}``
groups); ``deploy/prometheus.yml`` reads it, and Prometheus rereads it when it changes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS_FILE = "prometheus_targets.json"


def role_of(actor_name: str) -> str:
    """The ``role`` label of an actor: "gateway", "cache_node" or "spill_node"."""
    return actor_name.rstrip("0123456789").rstrip("_") or actor_name


def write_targets(addresses: dict[str, str], path: Path, deployment: str) -> Path:
    """Write ``addresses`` (actor name -> ``host:port``) as one file_sd group per actor, with
    labels ``role``, ``actor`` and ``deployment`` (the Ray namespace); atomic (a scraper never
    reads half a file). Returns ``path``."""
    groups = [{"targets": [address], "labels": {"role": role_of(name), "actor": name, "deployment": deployment}}
              for name, address in sorted(addresses.items())]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, path)
    return path
