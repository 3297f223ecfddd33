"""A run whose report folder cannot be written (its disk full, or the reports root no folder)
prints its summary all the same and fails naming the root and the error, ``latest`` left
pointing to the previous report; the run's folder is removed again unless its report.md was
written (then the error names it).

Regression (s40 diskfull): ``write_report``'s ``OSError`` left ``kvstrata run deepresearch``
with a traceback after the whole run, its outcome never shown.

The real job against the gRPC stand-in (``tests.test_workload_job``); the disk fills for real
(a 256 KiB tmpfs of its own, filled to its last byte, root only), and the reports root is a
file anywhere.
"""

from __future__ import annotations

import asyncio
import io
import os
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from kvstrata.v1 import inference_pb2_grpc
from tests.test_workload_grpc_client import StandIn
from tests.test_workload_job import CONFIG
from tests.tiny_disk import fill_disk, tiny_disk  # noqa: F401 - the fixture
from workloads.deepresearch.job import ReportNotWritten, run_deepresearch_grpc
from workloads.deepresearch.runner import RunOptions


def _job(root: Path, out: io.StringIO) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(StandIn(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await run_deepresearch_grpc(CONFIG, f"127.0.0.1:{port}", {"t": "good"}, timeout_s=10.0, root=root,
                                        options=RunOptions(time_scale=0.0, show_progress=False),
                                        console=Console(file=out, width=200))
        finally:
            await server.stop(None)

    asyncio.run(main())


@pytest.mark.parametrize("how", ["full_disk", "root_a_file"])
def test_a_report_that_cannot_be_written_still_prints_the_runs_summary(
    request: pytest.FixtureRequest, tmp_path: Path, how: str
) -> None:
    if how == "full_disk":
        root = request.getfixturevalue("tiny_disk")
        (root / "latest").symlink_to("deepresearch/20260101-000000")  # an earlier run's report
        before = os.readlink(root / "latest")
        fill_disk(root)
    else:
        root, before = tmp_path / "reports", None
        root.write_text("not a folder")
    out = io.StringIO()

    with pytest.raises(ReportNotWritten) as err:
        _job(root, out)

    assert str(root) in str(err.value) and "summary is above" in str(err.value)
    assert "All 17 sent calls succeeded." in out.getvalue()  # the run's summary
    if before is not None:
        assert os.readlink(root / "latest") == before
        # no half-written report folder left behind (s40 diff review r7 of a8aaa40: it stayed)
        assert list((root / "deepresearch").iterdir()) == [], list((root / "deepresearch").iterdir())


def test_a_report_whose_latest_link_cannot_be_made_is_kept_and_named(tmp_path: Path) -> None:
    """The report itself written, ``root/latest`` not (a folder of someone's there): the run's
    folder stays, and the error names it."""
    root = tmp_path / "reports"
    (root / "latest").mkdir(parents=True)
    (root / "latest" / "mine").write_text("not ours to remove")
    out = io.StringIO()

    with pytest.raises(ReportNotWritten) as err:
        _job(root, out)

    [run_dir] = (root / "deepresearch").iterdir()
    assert str(run_dir) in str(err.value) and (run_dir / "report.md").is_file(), str(err.value)
    assert (root / "latest" / "mine").is_file()
