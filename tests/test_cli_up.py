"""``kvstrata up`` when ``ray start`` fails: one line naming Ray's error, exit 1, nothing left
behind (a busy machine's failed ``ray start`` once ended ``up`` with a CalledProcessError
traceback and a stray temp directory); what ``up`` prints once started, ``status``'s table,
and the Prometheus config that reads the targets file ``up`` writes."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from cli import lifecycle, output
from cli import main as cli
from kvstrata.v1 import admin_pb2
from services.config import NodeConfig, ServiceConfig
from services.metrics.targets import TARGETS_FILE

ROOT = Path(__file__).resolve().parent.parent


def test_a_failed_ray_start_is_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `ray start` whose GCS cannot bind its port (held here): `up` prints one line naming
    Ray's error, exits 1, removes its temp directory and writes no gateway.json."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(lifecycle, "_free_port", lambda: taken.getsockname()[1])  # Ray's GCS cannot bind
        made: list[str] = []
        real_mkdtemp = lifecycle.tempfile.mkdtemp

        def mkdtemp(**kwargs: str) -> str:  # the real one, remembering the directory
            made.append(real_mkdtemp(**kwargs))
            return made[-1]

        monkeypatch.setattr(lifecycle.tempfile, "mkdtemp", mkdtemp)
        free_ports = tmp_path / "free-ports.yaml"  # another kvstrata on this machine may hold the defaults
        free_ports.write_text(yaml.safe_dump({"gateway_port": 0, "http_port": 0, "state_dir": str(tmp_path / "state")}))
        # `ray start`'s own client waits up to 5 + 5 + 30 s (connect, pubsub, cluster id) for a
        # GCS that died at once; these Ray settings, inherited by `ray start`, cut that to ~4 s
        result = CliRunner().invoke(cli.app, ["up", "--config", str(free_ports)],
                                    env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "1000",
                                         "RAY_gcs_rpc_server_connect_timeout_s": "1",
                                         "RAY_py_gcs_connect_timeout_s": "2"})
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 1, result.output
    assert len(lines) == 1 and lines[0].startswith("kvstrata up failed: `ray start --head --port="), result.output
    assert "Error" in lines[0] and "Traceback" not in result.output
    assert "Failed to start GCS" in lines[0], lines[0]  # the GCS's port was taken, not another failure
    assert made and not Path(made[0]).exists()  # the temp directory is gone
    assert not (tmp_path / "cli" / "gateway.json").exists()


def test_ray_start_error_prefers_the_exception_line() -> None:
    stderr = "Traceback (most recent call last):\n  File x\nRuntimeError: Failed to start GCS. Last lines:\n" \
             "\x1b[31mport taken\x1b[0m\n"
    assert lifecycle._ray_start_error(stderr, "INFO started") == \
        "RuntimeError: Failed to start GCS. Last lines: port taken"
    assert lifecycle._ray_start_error("", "line one\nline two\n") == "line two"


METRICS = {"gateway": "127.0.0.1:40001", "cache_node_0": "127.0.0.1:40002", "cache_node_1": "127.0.0.1:40003",
           "spill_node_0": "127.0.0.1:40004"}


def test_up_names_the_scheduler_and_prints_each_metrics_address_whole(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """H11 trial: `up` did not say which scheduler it runs, and printed the /metrics addresses
    as one line that rich wrapped at 80 columns mid-list ("spill_node_0 <newline> http://...");
    it now names the scheduler and device, and prints each address on a line of its own that is
    never wrapped, even on a 40-column terminal."""
    cfg = ServiceConfig(scheduler="vtc", node=NodeConfig(device="cpu", dtype="float32"), state_dir=str(tmp_path))
    lines = lifecycle.up_summary(cfg, "127.0.0.1:50051", "127.0.0.1:8000", METRICS, tmp_path / TARGETS_FILE)
    narrow = Console(file=io.StringIO(), width=40, color_system=None)
    monkeypatch.setattr(output, "console", narrow)
    for line in lines:
        output.say(line)
    printed = narrow.file.getvalue().splitlines()
    assert "scheduler: vtc on 2 cache nodes (cpu, float32); KV policy: per tenant or request (default: full)" \
        in printed
    for name, address in METRICS.items():
        assert any(line.split() == [name, f"http://{address}/metrics"] for line in printed), printed
    assert "gateway: 127.0.0.1:50051" in printed and "OpenAI-compatible API: http://127.0.0.1:8000/v1" in printed
    assert any(line.startswith(f"prometheus targets: {tmp_path / TARGETS_FILE} ") for line in printed)


def test_prometheus_config_reads_the_targets_file_next_to_it() -> None:
    """H11 trial: deploy/prometheus.yml named /home/ubuntu/.kvstrata/prometheus_targets.json, a
    path only one machine has; it names the targets file relative to the config's directory
    (Prometheus resolves file_sd paths against it), so the config copied into the state dir
    `up` prints reads the file `up` wrote there."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvstrata"]
    files = [f for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files == [TARGETS_FILE] and not any(Path(f).is_absolute() or "~" in f for f in files)


def test_status_says_skipped_without_the_integrity_check() -> None:
    """H11 trial: `status --no-integrity` left the integrity column blank; it says "skipped"."""
    resp = admin_pb2.StatsResponse(nodes=[admin_pb2.NodeStats(node_id="cache_node_0", integrity_ok=False,
                                                               integrity_error="block 3 freed twice")])
    for integrity, shown in ((False, "skipped"), (True, "block 3 freed twice")):
        console = Console(file=io.StringIO(), width=200, color_system=None)
        console.print(lifecycle.status_table(resp, integrity))
        row = next(line for line in console.file.getvalue().splitlines() if "cache_node_0" in line)
        assert row.split("│")[-2].strip() == shown
    ok = admin_pb2.StatsResponse(nodes=[admin_pb2.NodeStats(node_id="cache_node_0", integrity_ok=True)])
    console = Console(file=io.StringIO(), width=200, color_system=None)
    console.print(lifecycle.status_table(ok, True))
    assert "│ ok " in console.file.getvalue()


def test_the_state_dir_follows_kvstrata_state_dir_unless_the_config_names_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: KVSTRATA_STATE_DIR moved only the CLI's gateway.json; a `kvstrata up` with it
    set still wrote the tenant database and the admin key to ~/.kvstrata."""
    from services.config import load_config

    monkeypatch.setenv("KVSTRATA_STATE_DIR", str(tmp_path / "env"))
    assert ServiceConfig().state_path == tmp_path / "env"
    assert load_config(None).state_path == tmp_path / "env"
    named = tmp_path / "my.yaml"
    named.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "yaml")}))
    assert load_config(named).state_path == tmp_path / "yaml"
    monkeypatch.delenv("KVSTRATA_STATE_DIR")
    assert ServiceConfig().state_path == Path("~/.kvstrata").expanduser()


def test_a_relative_state_or_spill_dir_is_made_absolute_where_the_config_is_loaded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (review 23d, C): a relative state_dir (config or KVSTRATA_STATE_DIR) was
    saved relative, so a command run from another directory found no admin key, and on a
    joined cluster the actors resolved it against their own directories."""
    from services.config import load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVSTRATA_STATE_DIR", "relstate")
    assert ServiceConfig().state_dir == str(tmp_path / "relstate")
    named = tmp_path / "my.yaml"
    named.write_text(yaml.safe_dump({"state_dir": "a/b", "spill_dir": "sp"}))
    cfg = load_config(named)
    assert (cfg.state_dir, cfg.spill_dir) == (str(tmp_path / "a" / "b"), str(tmp_path / "sp"))
    assert ServiceConfig(spill_dir="").spill_dir == ""  # the default: <state_dir>/spill


def test_status_says_what_holds_the_used_blocks(tiny) -> None:
    """A fresh-user trial saw 39 blocks used with nothing running and no session: stored
    compressed prefixes held them, which nothing showed. The engine counts what idle sessions
    and stored prefixes hold, and `status` shows both."""
    from cache_node.sampling_params import SamplingParams
    from services.convert import node_stats_to_pb
    from tests.conftest import make_engine

    eng = make_engine(tiny)
    doc = [(7 * i) % 400 + 1 for i in range(100)]
    eng.generate([doc + [5, 6]], SamplingParams(max_tokens=2), policy="h2o-0.5", prefix_tokens=len(doc))
    eng.generate([doc[:40]], SamplingParams(max_tokens=2), session_id="s", tenant="t")
    stats = eng.stats()
    assert stats["running"] == 0 and stats["session_blocks"] > 0 and stats["compressed_prefix_blocks"] > 0
    assert stats["used_blocks"] == stats["session_blocks"] + stats["compressed_prefix_blocks"]
    node = node_stats_to_pb({"node_id": "cache_node_0", **stats})
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(lifecycle.status_table(admin_pb2.StatsResponse(nodes=[node]), False))
    header, row = (line for line in console.file.getvalue().splitlines() if "node " in line or "cache_node_0" in line)
    cells = dict(zip([c.strip() for c in header.split("┃")[1:-1]], [c.strip() for c in row.split("│")[1:-1]]))
    assert (cells["by sessions"], cells["by prefixes"]) == (str(stats["session_blocks"]),
                                                             str(stats["compressed_prefix_blocks"]))


def test_status_shows_each_nodes_health() -> None:
    """A fresh-user trial: a failed or restarted node showed nowhere in `kvstrata status` (only
    in AdminService.Stats' stats_json)."""
    nodes = [admin_pb2.NodeStats(node_id=f"cache_node_{i}") for i in range(3)]
    detail = {"nodes": [{"node_id": "cache_node_0", "healthy": True, "restarts": 0},
                        {"node_id": "cache_node_1", "healthy": True, "restarts": 2},
                        {"node_id": "cache_node_2", "healthy": False, "failure": "step loop failed"}]}
    resp = admin_pb2.StatsResponse(nodes=nodes, stats_json=json.dumps(detail))
    console = Console(file=io.StringIO(), width=250, color_system=None)
    console.print(lifecycle.status_table(resp, False))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.file.getvalue().splitlines() if "│ cache_node_" in line}
    assert rows == {"cache_node_0": "ok", "cache_node_1": "ok (restarted 2)",
                    "cache_node_2": "down: step loop failed"}


def test_up_help_tells_the_order_up_prints_in(tmp_path: Path) -> None:
    """A fresh-user trial: `kvstrata up --help` said it prints "the scheduler and the device ...,
    then each address", but `up` prints the gateway and HTTP addresses first; the help now
    names what `up_summary` prints, in its order."""
    result = CliRunner().invoke(cli.app, ["up", "--help"], env={"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())
    said = [text.index(part) for part in ("the gateway address", "OpenAI-compatible API address",
                                          "the scheduler and the device", "the admin key file",
                                          "each /metrics address", "Prometheus targets file")]
    assert said == sorted(said), text
    cfg = ServiceConfig(node=NodeConfig(device="cpu", dtype="float32"), state_dir=str(tmp_path))
    lines = lifecycle.up_summary(cfg, "127.0.0.1:50051", "127.0.0.1:8000", METRICS, tmp_path / TARGETS_FILE)
    printed = [next(i for i, line in enumerate(lines) if line.startswith(start))
               for start in ("gateway:", "OpenAI-compatible API:", "scheduler:", "admin key:", "metrics",
                             "prometheus targets:")]
    assert printed == sorted(printed), lines


@pytest.mark.parametrize("field", ["gateway_port", "http_port", "gateway_metrics_port"])
def test_a_taken_fixed_port_is_refused_before_anything_starts(tmp_path: Path, field: str) -> None:
    """Trial 30n P1: with port 8000 (the HTTP API's default, vLLM's and Jupyter's too) taken,
    `up` loaded the model for ~40 s and failed 'kvstrata up failed: ray::RayGateway.start()
    (pid=..., repr=...)'. Each fixed port it binds here is now checked first, naming its field."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump({"gateway_port": 0, "http_port": 0, "gateway_metrics_port": 0,
                                          field: port, "state_dir": str(tmp_path / "state")}))
        result = CliRunner().invoke(cli.app, ["up", "--config", str(config)],
                                    env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "1000"})
    assert result.exit_code == 1, result.output
    assert f"port {port} on 127.0.0.1 is taken; set {field} in the config (0 = any free port)" in result.output
    assert not (tmp_path / "cli" / "gateway.json").exists()


def test_an_actor_error_is_told_by_its_cause() -> None:
    """Trial 30n P1: an error raised in an actor's method (the gateway's bind failing) was
    printed as Ray's first line, 'ray::RayGateway.start() (pid=..., repr=...)', its cause dropped."""
    import ray.exceptions

    cause = OSError(98, "Address already in use")
    remote = ray.exceptions.RayTaskError("RayGateway.start", "Traceback ...\nOSError: [Errno 98] Address already in use",
                                         cause)
    assert lifecycle.failure_text(remote) == "OSError: [Errno 98] Address already in use"
    assert lifecycle.failure_text(RuntimeError("boom\nmore")) == "RuntimeError: boom"
    assert lifecycle.failure_text(ValueError()) == "ValueError()"


def test_an_actor_whose_constructor_raised_is_told_by_its_cause() -> None:
    """Session 40 new user: an actor whose class failed to import on its worker (or whose
    ``__init__`` raised) ends in Ray's ActorDiedError, which keeps no ``cause``; ``kvstrata up``
    printed only its first line, 'The actor died because of an error raised in its creation
    task, ray::global_scheduler:GlobalSchedulerService.__init__() (pid=..., repr=...)', and the
    AttributeError that said why was dropped. The error is built as Ray builds it from the
    creation task's RayTaskError (coloured header, remote traceback)."""
    import ray.exceptions

    said = "AttributeError: Can't get attribute 'Membership.admitted_from' on <module 'services.global_scheduler_members'>"
    init_error = ray.exceptions.RayTaskError(
        "global_scheduler:GlobalSchedulerService.__init__",
        f'Traceback (most recent call last):\n  File "worker.py", line 1, in load\n    load()\n{said}',
        AttributeError(said), proctitle="ray::global_scheduler:GlobalSchedulerService.__init__()",
        pid=21129, ip="192.0.2.2", actor_repr="<TemporaryActor object at 0x7f0c00670890>")
    died = ray.exceptions.ActorDiedError(init_error)
    assert str(died).startswith("The actor died because of an error raised in its creation task")
    assert lifecycle.failure_text(died) == said
    plain = ray.exceptions.ActorDiedError()  # no cause known: Ray's one sentence, as it is
    assert lifecycle.failure_text(plain) == ray.exceptions.ActorDiedError.BASE_ERROR_MSG


def test_another_error_naming_a_ray_process_keeps_its_first_line() -> None:
    """Only a Ray error's first line is read as Ray's header (s40 diff review r6 of 995683a):
    995683a took any first line naming ``ray::`` for one, and printed only the last line of
    this error, 'see the log', its type and message lost."""
    exc = RuntimeError("the gateway (ray::RayGateway.start()) did not answer in 30 s\nsee the log")
    assert lifecycle.failure_text(exc) == "RuntimeError: the gateway (ray::RayGateway.start()) did not answer in 30 s"


@pytest.mark.parametrize(("text", "said"), [
    ("gateway_port: [\n", "not valid YAML: expected the node content, but found '<stream end>' (line 2, column 1)"),
    ("node:\n  kv_pool_bytes: 1\n    block_size: 16\n",
     "not valid YAML: mapping values are not allowed here (line 3, column 15)"),
])
def test_a_config_that_is_not_yaml_says_what_and_where(tmp_path: Path, text: str, said: str) -> None:
    """Regression (s39 fresh-user trial): `up --config` with a YAML syntax error said only
    PyYAML's first line, its context: "Invalid value for '--config': my.yaml: while parsing a
    flow node", neither what is wrong nor on which line. Exit 2 (a usage error), nothing started."""
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    result = CliRunner().invoke(cli.app, ["up", "--config", str(config)],
                                env={"KVSTRATA_STATE_DIR": str(tmp_path / "cli"), "COLUMNS": "1000"})
    assert result.exit_code == 2, result.output
    assert f"{config}: {said}" in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "cli" / "gateway.json").exists()
