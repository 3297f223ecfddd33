"""kvstrata's actors import kvstrata's code from its installed location, never from the
directory a driver runs in (``kvstrata.code_path``; s41 trial finding F5).

Ray puts the driver's working directory at the front of its workers' ``sys.path``. A driver
run from a folder holding a ``services/`` package of its own (a user's project, another
checkout) so had kvstrata's actors import that folder's ``services``: here a decoy whose import
leaves a mark file and raises. The driver is a script in another directory (as the
``kvstrata`` console script is: its own ``sys.path`` has no working directory) that joins the
session's cluster and creates a spill node through the launcher's ``create_spill_node``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.code_path import CODE_ROOT, actor_runtime_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

DECOY = """\
import os, pathlib
pathlib.Path(__file__).with_name(f"imported-{os.getpid()}").write_text("decoy")
raise ImportError("the driver directory's decoy services package")
"""

DRIVER = """\
import os, sys
import ray
from services.spill_node import create_spill_node
from tests.test_spill_store import BLOCK, DISK, FMT

ray.init(address=sys.argv[1], namespace="kvstrata-test-cwd", log_to_driver=False)

@ray.remote(num_cpus=0)
def plain_worker():  # no kvstrata runtime_env: what Ray does with the driver's directory
    try:
        import services
        return os.getpid(), services.__file__
    except ImportError as e:
        return os.getpid(), str(e)

print("plain", *ray.get(plain_worker.remote(), timeout=120), flush=True)
node = create_spill_node("cwd-decoy-spill", sys.argv[2], FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK, max_restarts=0)
try:
    ray.get(node.ready.remote(), timeout=120)
    print("spill node ready", flush=True)
finally:
    ray.kill(node, no_restart=True)
"""


def test_actors_never_import_the_drivers_directory(ray_cluster, tmp_path: Path) -> None:
    """Before the fix the spill node's worker imported the decoy (its creation failed with the
    decoy's ImportError and a mark file named by the worker's pid); now only the plain task,
    created without kvstrata's runtime_env, reaches it (the premise: Ray does put the driver's
    directory first)."""
    cwd, drv = tmp_path / "project", tmp_path / "driver"
    (cwd / "services").mkdir(parents=True)
    (cwd / "services" / "__init__.py").write_text(DECOY)
    drv.mkdir()
    (drv / "drive.py").write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(drv / "drive.py"), ray_cluster.address, str(tmp_path / "spill")],
                          check=False, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=240)
    out = done.stdout + done.stderr[-3000:]
    plain = next(line.split() for line in done.stdout.splitlines() if line.startswith("plain "))
    assert "decoy" in done.stdout, out  # Ray did put the driver's directory first
    marks = sorted(p.name for p in (cwd / "services").glob("imported-*"))
    assert marks == [f"imported-{plain[1]}"], out  # only the plain task's worker imported it
    assert done.returncode == 0 and "spill node ready" in done.stdout, out


def test_runtime_env_keeps_the_callers_variables() -> None:
    env = actor_runtime_env({"RAY_worker_niceness": "0"})["env_vars"]
    assert env == {"RAY_worker_niceness": "0", "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "kvstrata.code_path.keep_own_imports"}


def _python(code: str, *args: str | Path, cwd: Path) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], check=False, cwd=cwd, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.splitlines()


def test_driver_directory_inserted_later_shadows_nothing(tmp_path: Path) -> None:
    """What a kvstrata actor's worker does: the hook at its start, then Ray inserting the
    driver's directory at ``sys.path[0]``; that directory's ``services/`` and ``colorsys.py``
    (a standard library module the worker has not imported yet) are never imported."""
    (tmp_path / "services").mkdir()
    (tmp_path / "services" / "__init__.py").write_text(DECOY)
    (tmp_path / "colorsys.py").write_text(DECOY)
    (tmp_path / "elsewhere").mkdir()  # the worker's own cwd: not the driver's directory
    code = ("import sys; from kvstrata.code_path import keep_own_imports; keep_own_imports(); keep_own_imports()\n"
            "sys.path.insert(0, sys.argv[1])\n"
            "import colorsys, services.config; print(colorsys.__file__); print(services.config.__file__)\n"
            "print(sum(type(f).__name__ == 'OwnPathFinder' for f in sys.meta_path))")
    lines = _python(code, tmp_path, cwd=tmp_path / "elsewhere")
    assert lines[0].endswith("/colorsys.py") and not lines[0].startswith(str(tmp_path)), lines
    assert lines[1:] == [str(Path(CODE_ROOT) / "services" / "config.py"), "1"]
    assert not list(tmp_path.rglob("imported-*"))


def test_hook_refuses_a_package_outside_the_code_root(tmp_path: Path) -> None:
    """A same-named package earlier on the worker's own path (``PYTHONPATH``) ends the worker
    with an ImportError naming it, rather than running it as kvstrata's."""
    (tmp_path / "tenants").mkdir()
    (tmp_path / "tenants" / "__init__.py").write_text("")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kvstrata.code_path import keep_own_imports\n"
            "try:\n    keep_own_imports()\nexcept ImportError as e:\n    print('refused', e)\n"
            "print('tenants' in sys.modules)")
    assert _python(code, tmp_path, cwd=tmp_path / "tenants") == [
        f"refused kvstrata package 'tenants' resolved to {tmp_path / 'tenants' / '__init__.py'}, not under {CODE_ROOT}",
        "False"]


HOOK_DRIVER = """\
import os, sys
import ray
from services.spill_node import create_spill_node
from tests.test_spill_store import BLOCK, DISK, FMT

MARKS = sys.argv[3]

def job_hook():  # the job's own worker setup hook, exported by value; 'kv-' in a kvstrata actor
    kvstrata = os.environ.get("__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR") == "kvstrata.code_path.keep_own_imports"
    open(os.path.join(MARKS, ("kv-" if kvstrata else "plain-") + str(os.getpid())), "w").close()

ray.init(address=sys.argv[1], namespace="kvstrata-test-cwd", log_to_driver=False,
         runtime_env={"worker_process_setup_hook": job_hook})
node = create_spill_node("job-hook-spill", sys.argv[2], FMT, ram_bytes=4 * BLOCK, disk_bytes=DISK, max_restarts=0)
try:
    ray.get(node.ready.remote(), timeout=120)
    print("spill node ready", flush=True)
finally:
    ray.kill(node, no_restart=True)
"""


def test_the_jobs_own_setup_hook_still_runs_in_kvstrata_actors(ray_cluster, tmp_path: Path) -> None:
    """A Ray job's ``worker_process_setup_hook`` (logging, tracing ...) runs in kvstrata's actors
    too, after kvstrata's own (review r8: actor_runtime_env's hook variable replaced the job's,
    so it silently never ran there)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "driver.py").write_text(HOOK_DRIVER)
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), ray_cluster.address, str(tmp_path / "spill"),
                           str(marks)], check=False, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0 and "spill node ready" in done.stdout, out
    assert [p.name for p in marks.glob("kv-*")], (sorted(p.name for p in marks.iterdir()), out)
