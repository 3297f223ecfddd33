"""``make test``'s xdist scheduling (tests/xdist_order.py) on a synthetic suite run in 2 workers.

Failed on the code before it (xdist's own loadfile): the two files using the session's Ray
fixture went one to each worker (the fixture was built twice), and the one heavy file, having
the fewest tests, was dealt last.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xdist_order import RAY_GROUP, longest_first, unit_of_ray

pytest.importorskip("xdist")

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os
import pytest
from tests import xdist_order
from tests.xdist_order import (pytest_configure, pytest_configure_node, pytest_runtest_teardown,
                               pytest_unconfigure, pytest_xdist_make_scheduler, write_ray_files)

xdist_order.KNOWN_SECONDS["test_heavy"] = 1000.0


def pytest_collection_modifyitems(config, items):
    write_ray_files(config, items)


def _log(what):
    with open(os.environ["XDIST_ORDER_LOG"], "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')} {what}\\n")


@pytest.fixture(scope="session")
def ray_cluster():
    _log("BUILT ray_cluster")
    yield object()
    _log("ENDED ray_cluster")


@pytest.fixture(scope="session")
def stack(ray_cluster):
    yield ray_cluster
    _log("ENDED stack")


@pytest.fixture(autouse=True)
def _ran(request):
    _log(request.node.nodeid)
'''


def _tests(n: int, fixture: str = "") -> str:
    return "".join(f"def test_{i}({fixture}):\n    pass\n\n\n" for i in range(n))


def test_the_ray_files_share_one_worker_and_the_longest_file_goes_first(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    # xdist's own order deals the most tests first: the two Ray files, one per worker
    (suite / "test_a_ray.py").write_text(_tests(6, "ray_cluster"))
    (suite / "test_b_ray.py").write_text("import pytest\n\n\n@pytest.fixture(scope='module')\n"
                                         "def built(stack):\n    return stack\n\n\n" + _tests(5, "built"))
    (suite / "test_c.py").write_text(_tests(3))
    (suite / "test_d.py").write_text(_tests(2))
    (suite / "test_heavy.py").write_text(_tests(1))
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDIST_ORDER_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider"],
                       check=False, cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "17 passed" in r.stdout, r.stdout[-2000:]
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    built = [worker for worker, what in lines if what == "BUILT ray_cluster"]
    assert len(built) == 1, lines
    ray_workers = {worker for worker, what in lines if "_ray.py::" in what}
    assert ray_workers == set(built), lines
    heavy = next(worker for worker, what in lines if what.startswith("test_heavy.py::"))
    first_on_its_worker = next(what for worker, what in lines if worker == heavy and "::" in what)
    assert first_on_its_worker == "test_heavy.py::test_0", lines
    assert heavy not in ray_workers, lines  # the two longest units start at once, one per worker


def _run(suite: Path, log: Path, *args: str) -> list[tuple[str, str]]:
    """Run the synthetic ``suite`` with pytest ``args``: its log, (worker, what) a line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDIST_ORDER_LOG": str(log)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                       check=False, cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "7 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    lines = [line.split(" ", 1) for line in log.read_text().splitlines()]
    log.unlink()
    return [(worker, what) for worker, what in lines]


def test_the_ray_fixtures_end_as_the_worker_leaves_the_ray_files(tmp_path: Path) -> None:
    """In a ``--dist loadfile`` worker the session's Ray fixtures (the services first, a module
    fixture on them before) end after the group's last test, before the next file's first: on
    the code before, at the session's end, after test_b.py (an idle cluster and services
    beside every later file). Without xdist the Ray files are not contiguous (test_b.py runs
    between them): the cluster is built once and ends with the session."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\n")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_a_ray.py").write_text(_tests(3, "ray_cluster"))
    (suite / "test_b.py").write_text(_tests(2))
    (suite / "test_c_ray.py").write_text("import pytest\nfrom conftest import _log\n\n\n"
                                         "@pytest.fixture(scope='module')\ndef built(stack):\n"
                                         "    yield stack\n    _log('ENDED built')\n\n\n" + _tests(2, "built"))
    log = tmp_path / "log"
    # one worker: the Ray group (5 tests, 2.5 s by DEFAULT_SECONDS_PER_TEST) first, then test_b.py
    grouped = [what for _, what in _run(suite, log, "-n", "1", "--dist", "loadfile")]
    assert grouped == ["BUILT ray_cluster", *(f"test_a_ray.py::test_{i}" for i in range(3)),
                       *(f"test_c_ray.py::test_{i}" for i in range(2)), "ENDED built", "ENDED stack",
                       "ENDED ray_cluster", "test_b.py::test_0", "test_b.py::test_1"], grouped
    plain = [what for _, what in _run(suite, log, "-p", "no:xdist")]
    assert plain == ["BUILT ray_cluster", *(f"test_a_ray.py::test_{i}" for i in range(3)), "test_b.py::test_0",
                     "test_b.py::test_1", *(f"test_c_ray.py::test_{i}" for i in range(2)), "ENDED built",
                     "ENDED stack", "ENDED ray_cluster"], plain


def test_units_and_their_order() -> None:
    ray = {"tests/test_a.py", "tests/test_b.py"}
    assert unit_of_ray("tests/test_a.py::test_x[1-2]", ray) == RAY_GROUP
    assert unit_of_ray("tests/test_c.py::Cls::test_y", ray) == "tests/test_c.py"
    units = {"tests/test_many.py": [f"tests/test_many.py::t{i}" for i in range(30)],  # 0.5 s a test: 15
             "tests/test_kernels_paged_attention.py": ["tests/test_kernels_paged_attention.py::t"],  # known
             "tests/test_few.py": ["tests/test_few.py::t"],
             "tests/test_few2.py": ["tests/test_few2.py::t"]}
    assert longest_first(units) == ["tests/test_kernels_paged_attention.py", "tests/test_many.py",
                                    "tests/test_few.py", "tests/test_few2.py"]


def test_a_file_whose_ray_tests_are_deselected_does_not_end_the_ray_fixtures_mid_group(tmp_path: Path) -> None:
    """``-m 'not chaos'`` (``make test``), ``-k`` or ``--lf`` deselect items after the workers
    named the Ray files: a file whose only Ray test is deselected is still in the controller's
    group, between Ray files. Regression (s41 review of 3010abf): the worker read the group from
    the selected items, so it ended the fixtures as it left test_a_ray.py for that file and
    built the cluster again for test_c_ray.py (a real cluster and services: ~40-50 s more)."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    chaos: heavy\n")
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_a_ray.py").write_text(_tests(2, "ray_cluster"))
    (suite / "test_b_mixed.py").write_text("import pytest\n\n\n@pytest.mark.chaos\ndef test_ray(stack):\n"
                                           "    pass\n\n\ndef test_plain():\n    pass\n")
    (suite / "test_c_ray.py").write_text(_tests(2, "stack"))
    (suite / "test_d.py").write_text(_tests(1))
    log = tmp_path / "log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDIST_ORDER_LOG": str(log)}
    # -k and --lf deselect at the same point as -m (after the conftest's modifyitems): one run
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "1", "--dist",
                        "loadfile", "-m", "not chaos"], check=False, cwd=suite, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "6 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    ran = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    assert ran == ["BUILT ray_cluster", "test_a_ray.py::test_0", "test_a_ray.py::test_1", "test_b_mixed.py::test_plain",
                   "test_c_ray.py::test_0", "test_c_ray.py::test_1", "ENDED stack", "ENDED ray_cluster",
                   "test_d.py::test_0"], ran
