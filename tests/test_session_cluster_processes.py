"""The session's Ray cluster (``tests.service_fixtures.start_cluster``) runs no process that no
test needs: on the 2-core test machine every one of them takes CPU from the tests."""

from __future__ import annotations

import psutil


def _cluster_process_names() -> list[str]:
    """Names of this process's descendants (``ray.cluster_utils.Cluster`` starts its GCS,
    raylets, dashboard and agents as children of the driver), sorted."""
    names = []
    for proc in psutil.Process().children(recursive=True):
        try:
            names.append(proc.name())
        except psutil.Error:  # ended meanwhile
            pass
    return sorted(names)


def test_the_session_cluster_runs_no_dashboard(ray_cluster) -> None:
    """Regression: the session cluster started Ray's dashboard UI, nine ``ray-dashboard-*Head``
    module processes (forked by the dashboard's head, which Ray runs either way for its state
    and job APIs) that no test reads (``ray._private.state`` asks the GCS): 23 processes
    instead of 12, ~1-4 s more CPU at the start and ~0.7-0.9 s more every 30 s after, for the
    ~10 min the Ray files hold the cluster."""
    names = _cluster_process_names()
    assert "gcs_server" in names and names.count("raylet") >= 2, names  # the cluster is ours
    assert [name for name in names if name.startswith("ray-dashboard-")] == [], names
