"""The local Ray cluster a plain ``kvstrata up`` starts refuses drivers without its token
(``services.ray_auth``).

Regression (review 23d, A): it ran with ``RAY_AUTH_MODE=disabled``; its GCS listens on every
interface, and a driver connecting to the machine's address ran a task that read the 0600
admin key, which then listed every tenant.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import ray.util

from cli import lifecycle
from services.config import ServiceConfig
from services.ray_auth import TOKEN_FILE, new_token_file, token_env

ROOT = Path(__file__).resolve().parent.parent
FAST_FAIL = {"RAY_gcs_rpc_server_connect_timeout_s": "1", "RAY_py_gcs_connect_timeout_s": "3",
             "RAY_gcs_server_port_wait_time_s": "3"}
"""Ray settings that end a refused driver's retries in seconds, not a minute: a driver asks
the GCS for its cluster id once a second, ``RAY_gcs_server_port_wait_time_s`` times (20
without it: ``ray._private.node.Node._init_gcs_client``); a driver with the token is answered
at its first try."""

DRIVER = textwrap.dedent("""
    import os, sys
    if sys.argv[2]:
        from services.ray_auth import use_token
        import ray  # imported first, as other modules may: use_token refreshes Ray's mode
        use_token(sys.argv[2])
    import ray
    try:
        ray.init(address=sys.argv[1], log_to_driver=False)
    except ConnectionError:
        print("refused")
        raise SystemExit(0)
    print("task ran" if ray.get(ray.remote(lambda: 1).remote(), timeout=60) == 1 else "?")
""")


def _drivers(runs: list[tuple[str, str]]) -> list[str]:
    """``DRIVER`` once per (address, token), all at once (a refused driver spends its
    ``FAST_FAIL`` retries asleep); each one's last line of output (or its stderr's end), with
    " (unauthenticated)" added where Ray logged that the GCS refused its token."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT), **FAST_FAIL}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    procs = [subprocess.Popen([sys.executable, "-c", DRIVER, address, token], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for address, token in runs]
    outs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=180)
            out = stdout.strip().splitlines()[-1] if stdout.strip() else stderr[-500:]
            outs.append(out + (" (unauthenticated)" if "InvalidAuthToken" in stderr else ""))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs


def test_the_local_cluster_refuses_a_driver_without_its_token(tmp_path: Path, caplog) -> None:
    """Also: the cluster stops promptly, each of its processes on SIGTERM (what ``kvstrata
    down`` does to it). Before, its GCS server never exited on SIGTERM while its clients were
    alive, nor they while it was stuck, so every stop took ``stop_processes``' 10-s timeout and
    SIGKILLed the GCS, the raylet and the autoscaler monitor."""
    token = new_token_file(tmp_path / "state")
    assert token.name == TOKEN_FILE and stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text()) == 64 and token_env(token)["RAY_AUTH_MODE"] == "token"
    port, temp_dir = lifecycle._start_local_ray(ServiceConfig(), token)
    try:
        # Ray makes its temp dir 0777; ours around it stays the user's alone (review 23d)
        assert stat.S_IMODE(Path(temp_dir).stat().st_mode) == 0o700
        sockets = list(Path(temp_dir).glob("ray/session_*/sockets"))
        assert sockets and all(s.resolve().is_relative_to(Path(temp_dir).resolve()) for s in sockets)
        ip = ray.util.get_node_ip_address()  # the machine's address, as a peer reaches it
        hosts = sorted({ip, "127.0.0.1"})
        *refused, ran = _drivers([(f"{host}:{port}", "") for host in hosts] + [(f"127.0.0.1:{port}", str(token))])
        assert refused == ["refused (unauthenticated)"] * len(hosts), (hosts, refused)  # "task ran" before
        assert ran == "task ran"
    finally:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="cli.processes"):
            stopped = lifecycle._stop_local_ray(temp_dir, port)
        took = time.monotonic() - start
    assert stopped >= 4  # GCS, raylet, monitor, client server, agents, ...
    assert not [r.getMessage() for r in caplog.records if r.name == "cli.processes"]  # none SIGKILLed
    assert took < 9, took  # 10.x s before (the SIGTERM timeout, then SIGKILL); ~1 s here
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if any(temp_dir in a for a in p.info["cmdline"] or ())]
    assert left == []


START_SERVICES = textwrap.dedent("""
    import json, os, sys
    import ray
    from services import launcher
    from services.config import ServiceConfig

    def init(**kwargs):
        print(json.dumps({"address": kwargs.get("address"), "mode": os.environ.get("RAY_AUTH_MODE"),
                          "token": os.environ.get("RAY_AUTH_TOKEN_PATH")}))
        raise SystemExit(0)

    ray.init = init
    launcher.start_services(ServiceConfig(state_dir=sys.argv[1]))
""")


def test_the_local_cluster_start_services_starts_is_token_authenticated(tmp_path: Path) -> None:
    """The demo (``python -m workloads.demo``) and the benches start their own local cluster
    through ``start_services``; it listens on the machine's address too. Before, it ran with
    ``RAY_AUTH_MODE=disabled`` (the modules' default): any driver reaching it ran tasks. Now
    ``ray.init`` runs with a new token in the state dir (the cluster then refuses a driver
    without it: ``test_the_local_cluster_refuses_a_driver_without_its_token``)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    done = subprocess.run([sys.executable, "-c", START_SERVICES, str(tmp_path / "state")], check=True, env=env,
                          capture_output=True, text=True, timeout=180)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    token = tmp_path / "state" / TOKEN_FILE
    assert seen == {"address": "local", "mode": "token", "token": str(token)}
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64


BENCH_LOCAL = textwrap.dedent("""
    import json, os, sys
    import ray
    from bench import chaos_stack

    def init(**kwargs):
        print(json.dumps({"address": kwargs.get("address"), "mode": os.environ.get("RAY_AUTH_MODE"),
                          "token": os.environ.get("RAY_AUTH_TOKEN_PATH")}))
        raise SystemExit(0)

    ray.init = init
    chaos_stack.ray_local({"cache_node": 1})
""")


def test_the_benches_local_clusters_are_token_authenticated(tmp_path: Path) -> None:
    """bench.chaos, bench.service and bench.slo start their own local cluster with ``ray.init``
    before ``start_services`` (which then starts none): it ran with RAY_AUTH_MODE=disabled on
    the machine's address for the bench's duration. Now ``services.ray_auth.init_local_cluster``
    presents a new token in a private directory first."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    done = subprocess.run([sys.executable, "-c", BENCH_LOCAL], check=True, env=env, capture_output=True, text=True,
                          timeout=180)
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    token = Path(seen["token"])
    assert seen["address"] == "local" and seen["mode"] == "token" and token.name == TOKEN_FILE
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    for bench in ("service", "slo"):  # the same call in the others
        assert "init_local_cluster(" in (ROOT / "bench" / f"{bench}.py").read_text()
