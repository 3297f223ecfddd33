"""What a ``kvstrata`` command imports: Ray and ``services.config`` only where the command
needs them (``up`` and ``down``), torch and transformers in none (the actors ``up`` starts
import them in their own processes). ``--help``, the gRPC client commands (``generate``,
``close-session``, ``status``) and the admin and tenant commands import none of them (trial
P10: every command paid ~1.1 s of ``import torch``, ~3 s on a loaded machine, because
``cli.lifecycle`` imported ``services.config``, which then imported torch, at module level).

Each command runs in a fresh interpreter (``cli.main``'s app called as the ``kvstrata`` script
calls it), which then reports what ``sys.modules`` holds."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstrata.v1 import inference_pb2_grpc
from tests.test_cli_generate import RecordingInference

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "transformers", "ray", "services.config", "cache_node.config")

RUN = """
import json, sys
from cli.main import app
reports = []
for args in json.loads(sys.argv[1]):
    try:
        app(args=args, prog_name="kvstrata")
        code = 0
    except SystemExit as exc:
        code = exc.code
    reports.append({"code": code, "loaded": [m for m in json.loads(sys.argv[2]) if m in sys.modules]})
print("\\n" + json.dumps(reports))
"""


def run_cli(commands: list[list[str]], tmp_path: Path) -> tuple[list[dict[str, Any]], str]:
    """Run each ``kvstrata ARGS`` of ``commands`` in turn in one fresh interpreter (its own
    empty state directory): ({"code": exit code, "loaded": the ``HEAVY`` modules loaded so far}
    after each, the output). Modules only accumulate, so the first command whose ``loaded`` is
    not empty is the one that imported them."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KVSTRATA_STATE_DIR": str(tmp_path / "state"),
           "KVSTRATA_API_KEY": "k", "KVSTRATA_ADMIN_KEY": "kvs_0123456789ab_" + "A" * 43, "COLUMNS": "200"}
    out = subprocess.run([sys.executable, "-c", RUN, json.dumps(commands), json.dumps(HEAVY)], cwd=ROOT, env=env, check=False,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.rstrip().rpartition("\n")[2]), out.stdout + out.stderr


@pytest.fixture()
def gateway() -> Iterator[str]:
    """A gRPC server answering ``Generate`` (``RecordingInference``: "ok", finish reason stop);
    any other call is UNIMPLEMENTED (exit 1, at once: a refused port costs the CLI ~1 s)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(RecordingInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


COMMANDS = [  # (args, exit code)
    (["--help"], 0),
    (["generate", "--help"], 0),
    (["up", "--help"], 0),
    (["generate", "hi", "--gateway", "{gateway}"], 0),
    (["generate", "--session", "s", "--tool-result", "call_1=sunny", "--gateway", "{gateway}"], 0),
    (["close-session", "s", "--gateway", "{gateway}"], 1),
    (["status", "--gateway", "{gateway}"], 1),
    (["admin", "flush", "--gateway", "{gateway}"], 1),
    (["tenant", "list", "--gateway", "{gateway}"], 1),
]


def test_a_command_that_builds_no_model_imports_no_torch(gateway: str, tmp_path: Path) -> None:
    """``--help``, ``generate`` (a gRPC client, tool results too), ``close-session``,
    ``status``, ``admin`` and ``tenant`` import none of ``HEAVY``."""
    reports, output = run_cli([[a.replace("{gateway}", gateway) for a in args] for args, _ in COMMANDS], tmp_path)
    for (args, code), report in zip(COMMANDS, reports, strict=True):
        assert report["code"] == code, (args, output)
        assert report["loaded"] == [], f"kvstrata {' '.join(args)} imported {report['loaded']}"


def test_up_still_reads_its_config(tmp_path: Path) -> None:
    """``up`` imports ``services.config`` when it runs: a bad config is still the usage error
    naming ``--config`` and the field (exit 2), before Ray or any service is started.

    It has imported ``services.launcher`` by then, and with it neither torch nor transformers
    (the actors it starts import them in their own processes). Regression (s39): the launcher
    imported both (``AutoConfig`` for the spill tier's block format; the cache node and
    gateway actor modules for ``CacheNodeRemote`` and ``GatewayActor``): ~5 s of CPU, 25.7 s
    on a loaded 2-core host, on every ``kvstrata up``."""
    config = tmp_path / "bad.yaml"
    config.write_text("gateway_port: -5\n")
    [report], output = run_cli([["up", "--config", str(config)]], tmp_path)
    assert report["code"] == 2, output
    assert "--config" in output and "gateway_port" in output, output
    assert "services.config" in report["loaded"]
    assert "ray" in report["loaded"]  # (``up`` imports Ray and the launcher before reading the config)
    assert [m for m in report["loaded"] if m in ("torch", "transformers")] == []
