"""How ``make test`` deals the test files out to its pytest-xdist workers (``--dist loadfile``,
with ``FileOrRayScheduling`` in place of xdist's scheduler: ``tests/conftest.py``).

Each test file is one work unit, whole in one worker (its module fixtures built once), as with
xdist's loadfile, except the files that use the session's Ray fixtures (``ray_cluster``,
``stack``): together they are one unit, ``RAY_GROUP``, so that one worker alone starts the
two-node Ray cluster and the kvstrata services (~40-50 s on the loaded 2-core host; each worker
started its own before). The units go out longest first (``KNOWN_SECONDS``): xdist's own order
(most tests first) left single heavy files such as test_deepresearch_e2e for the end, one
worker busy with them while the other idled.

The workers know which files use the Ray fixtures (their collection), the controller does not:
each worker writes them (``write_ray_files``) to the directory the controller gave it
(``UNITS_DIR_KEY`` in its ``workerinput``), which the controller reads once every worker has
collected (``FileOrRayScheduling.schedule``). Without it (no file), every file is its own unit.
xdist's ``loadgroup`` cannot carry this: it tags nodeids through ``Item._nodeid``, which pytest
9.2 no longer reads (its nodeids came back untagged: one unit per test).

The worker that runs ``RAY_GROUP`` ends the session's Ray fixtures as it leaves the group
(``pytest_runtest_teardown``), not at the session's end: idle, the cluster and the kvstrata
services took ~10% of a core (6.2 s of CPU in 60 s, measured) for the rest of the session: in
CI the group runs first, ~350 s of ~950. Without the grouping (no xdist, ``TEST_WORKERS=0``) the Ray files
are not contiguous and the fixtures live the whole session.

``tests/conftest.py`` imports the hooks at the end of this module (``pytest_configure`` ...
``pytest_xdist_make_scheduler``); a synthetic suite's conftest can import them alone
(tests/test_xdist_order.py). Only the order and the grouping change: every test runs, each file whole in one worker."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

RAY_GROUP = "ray-session"
"""The work unit of every file using the session's Ray cluster (``ray_cluster``, ``stack``)."""

RAY_FIXTURES = frozenset({"ray_cluster", "stack"})

RAY_TEARDOWN_ORDER = ("stack", "ray_cluster")
"""``RAY_FIXTURES`` in the order ``end_ray_fixtures`` finishes them (the services before their cluster)."""

UNITS_DIR_KEY = "kvstrata_units_dir"
"""``workerinput`` key: where a worker writes its ``ray_files`` (``<worker id>.json``)."""

DEFAULT_SECONDS_PER_TEST = 0.5
"""What a file missing from ``KNOWN_SECONDS`` counts per test (most files under 4 s took
0.1-0.5 s a test)."""

KNOWN_SECONDS: dict[str, float] = {
    # seconds per file (setup + calls + teardown, pytest's junit times), from the 2-worker
    # clean-clone CI of 2026-12-07 (session 40, on 0723c85, host loaded: 1.45x the figures of
    # session 39's list for the files of 8 s or more in both, so divided by 1.45); files of at
    # least 4 s. Only the order of the work units depends on them: a stale figure costs
    # balance, never a test.
    "test_kernels_paged_attention": 54, "test_gpu_check": 44, "test_structured_output_engine": 44,
    "test_services_restart": 44, "test_kv_exact_differential": 55, "test_services_integration": 38,
    "test_deepresearch_e2e": 35, "test_grammar_compile_limits": 33, "test_preemption_liveness": 33,
    "test_admin_flush_spill_silent": 32, "test_node_failure": 32, "test_engine_device": 31,
    "test_engine_soak": 28, "test_session_stop_race": 28, "test_gateway_streams_pause": 27,
    "test_spill_recreate": 27, "test_session_tool_calls": 27, "test_policy_chunking": 27,
    "test_openai_api": 26, "test_fuzz_rpc": 25, "test_session_retokenize": 25,
    "test_compressed_prefix": 25, "test_engine_progress": 25, "test_gateway_render_children": 24,
    "test_gateway_render_faults": 24, "test_node_render_child": 24, "test_session_turn_cancel": 24,
    "test_session_stop_cut": 23, "test_session_policy": 23, "test_cache_node_streams": 23,
    "test_prompt_logprobs": 23, "test_quality_served": 22, "test_engine_real_model": 22,
    "test_node_admin": 21, "test_spill_status": 21, "test_openai_api_parse_turns": 21,
    "test_session_map": 21, "test_cli_down": 20, "test_scheduler_restart": 19,
    "test_recall_bound": 19, "test_data_plane_security": 19, "test_grammar_child_replies": 18,
    "test_auto_undeclared_calls": 18, "test_gateway_restart_start": 18,
    "test_tool_calls_served": 18, "test_cli_ray_auth": 17, "test_grammar_compile_cpu_limit": 17,
    "test_structured_output_step_limits": 17, "test_data_plane_limits": 17,
    "test_grammar_child_stalls": 16, "test_services_tenancy": 16, "test_render_child_tenants": 16,
    "test_spill_lock_wait": 15, "test_compressed_prefix_admission": 15, "test_tier_real_model": 15,
    "test_grammar_child_sandbox": 15, "test_admin_key_recovery": 14, "test_tier_ray": 14,
    "test_workload_agents_engine": 13, "test_node_step_stall": 13, "test_node_stop_strings": 13,
    "test_grammar_namespaces": 13, "test_spill_node": 12, "test_gateway_pause": 12,
    "test_session_reopen": 12, "test_grpc_tool_calls": 12, "test_cli_tool_results": 12,
    "test_openai_api_connections": 12, "test_render_child_inputs": 12, "test_fused_layers": 12,
    "test_gateway_render_served": 11, "test_openai_api_send_bounds": 11,
    "test_session_tool_turns": 11, "test_structured_output_served": 10,
    "test_openai_api_slow_reader": 10, "test_admin_drain_key": 10, "test_kernels_fused_ops": 10,
    "test_gateway_gone": 9, "test_session_lost_markers": 9, "test_client_keepalive": 9,
    "test_metrics_server_bounds": 9, "test_gateway_restart_ports": 9,
    "test_grpc_connection_bounds": 9, "test_cli_errors": 9, "test_cli_up": 9,
    "test_session_state_dropped": 9, "test_tls_gateway": 9, "test_node_shutdown_grammars": 9,
    "test_spill_missing_at_start": 8, "test_auth_key_directory": 8, "test_grpc_wire_unrepeated": 8,
    "test_auto_tool_constraint": 8, "test_node_stale_render": 8,
    "test_tiny_checkpoint_concurrent": 8, "test_prompt_logprobs_api": 8,
    "test_stop_kills_recreated_spill": 7, "test_bench_engine": 7, "test_cli_constraints": 7,
    "test_key_watch_unconfirmed": 7, "test_metrics_node_requests": 7,
    "test_chat_template_refusals": 7, "test_node_stream_handover": 7,
    "test_grammar_child_tenants": 7, "test_block_reports": 6, "test_scheduler_tells": 6,
    "test_spill_not_serving": 6, "test_cli_imports": 6, "test_policy_windows": 6,
    "test_stream_key_revoked": 6, "test_prefill_graphs": 6, "test_tier_faults": 6,
    "test_scheduler_silent_health": 6, "test_grammar_wait_event": 6, "test_deleted_tenant_cache": 6,
    "test_openai_api_nulls": 6, "test_spill_disk_faults": 6, "test_stale_key_other_gateway": 6,
    "test_gateway_reconcile": 6, "test_launcher_start_order": 5, "test_metrics": 5,
    "test_node_waiting_steps": 5, "test_spill_await_race": 5, "test_engine": 5,
    "test_logprobs_served": 5, "test_client_ids": 5, "test_grammar_tenant_limits": 5,
    "test_policies": 5, "test_openai_api_lingering": 5, "test_scheduler_poll_errors": 5,
    "test_gateway_stream_config": 5, "test_kv_oracle_fuzz": 5, "test_openai_api_choices": 5,
    "test_openai_tokenize": 5, "test_routing_keys": 5, "test_tier_close": 5,
    "test_spill_drop_ray": 4, "test_slo_floors": 4, "test_key_watch_ended": 4,
    "test_child_close_races": 4, "test_logit_bias_served": 4,
    "test_openai_api_https_connections": 4, "test_metrics_scrape_cache": 4,
    # files added or grown in session 41 (its candidate CI on 6c5375c, quiet part of the run;
    # test_workload_register_interrupt from its own runs: its CI run failed, running to the end)
    "test_gateway_scheduler_unreachable": 23, "test_workload_register_interrupt": 20, "test_code_path": 18,
    "test_gateway_served_forget": 16, "test_store_failure_ray": 13, "test_spill_owner_died": 12,
    "test_sampler_logit_bias": 10, "test_openai_api_fuzz": 10, "test_xdist_order": 8,
    "test_openai_api_choices_admission": 8, "test_kill_gone_stopped": 7, "test_scheduler_silent_in_flight": 6,
    "test_cache_node_stopped_calls": 6, "test_openai_api_extensions": 5, "test_peer_outbox": 5,
    "test_gateway_event_turns": 5, "test_peer_calls_by_keyword": 5, "test_scheduler_call_deadlines": 5,
    "test_store_failure_answers": 5, "test_openai_api_pipelined_refusal": 4,
}


def file_of(nodeid: str) -> str:
    """The test file of a nodeid (``tests/test_x.py::test_y[p]`` -> ``tests/test_x.py``)."""
    return nodeid.split("::", 1)[0]


def ray_files(items: Iterable[pytest.Item]) -> list[str]:
    """The files (as nodeids start) with an item using ``RAY_FIXTURES``, sorted."""
    return sorted({file_of(i.nodeid) for i in items if RAY_FIXTURES & set(getattr(i, "fixturenames", ()))})


_RAY_FILES = pytest.StashKey[frozenset[str]]()
"""The ``ray_files`` this worker wrote (``write_ray_files``): what the controller grouped."""


def write_ray_files(config: pytest.Config, items: Iterable[pytest.Item]) -> None:
    """In an xdist worker the controller gave ``UNITS_DIR_KEY``: write ``ray_files`` there,
    and keep them (``leaves_ray_group`` reads the same list)."""
    units_dir = getattr(config, "workerinput", {}).get(UNITS_DIR_KEY)
    if units_dir:
        files = ray_files(items)
        config.stash[_RAY_FILES] = frozenset(files)
        target = Path(units_dir) / f"{config.workerinput['workerid']}.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(files))
        os.replace(tmp, target)


def groups_ray_files(config: pytest.Config) -> bool:
    """Whether this process is an xdist worker of a ``make_scheduler`` run: its ``RAY_GROUP``
    tests come to it together, one after another."""
    return UNITS_DIR_KEY in getattr(config, "workerinput", {})


def leaves_ray_group(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Whether ``item`` is the last test of ``RAY_GROUP`` this worker runs before ``nextitem``
    (``None``: the session ends, its teardown ends the fixtures anyway).

    The group is the files ``write_ray_files`` named, as the controller dealt it: they are
    written before ``-m`` / ``-k`` / ``--lf`` deselect items, so a file whose only Ray tests
    were deselected is in the group, its selected tests run inside it. Regression (s41
    review): the files were read from the selected items here, so leaving a Ray file for such
    a file ended the fixtures mid-group and the next Ray file built the cluster again."""
    if nextitem is None or not groups_ray_files(item.config):
        return False
    if _RAY_FILES not in item.config.stash:  # a conftest without write_ray_files
        item.config.stash[_RAY_FILES] = frozenset(ray_files(item.session.items))
    files = item.config.stash[_RAY_FILES]
    return file_of(item.nodeid) in files and file_of(nextitem.nodeid) not in files


def end_ray_fixtures(item: pytest.Item) -> None:
    """Finish the session's ``RAY_FIXTURES`` that are built, and with them every fixture built
    on them (pytest registered their finalizers on these). Session teardown later finds them
    finished; a later test asking for one would build it again. Uses pytest's fixture
    manager and ``FixtureDef.finish`` (internal; checked with pytest 9.2)."""
    for name in RAY_TEARDOWN_ORDER:
        for fixturedef in item.session._fixturemanager.getfixturedefs(name, item) or ():
            fixturedef.finish(item._request)  # type: ignore[attr-defined]


def read_ray_files(units_dir: str) -> set[str]:
    """The files every worker wrote (each the same, from the same collection)."""
    files: set[str] = set()
    for path in Path(units_dir).glob("*.json"):
        files.update(json.loads(path.read_text()))
    return files


def unit_of_ray(nodeid: str, ray_files: set[str]) -> str:
    """A nodeid's work unit: ``RAY_GROUP`` for a test of one of ``ray_files``, else its file."""
    path = file_of(nodeid)
    return RAY_GROUP if path in ray_files else path


def unit_seconds(nodeids: Iterable[str]) -> float:
    """A work unit's expected seconds: ``KNOWN_SECONDS`` of each of its files, else
    ``DEFAULT_SECONDS_PER_TEST`` for each of its tests there."""
    tests: dict[str, int] = {}
    for nodeid in nodeids:
        tests[file_of(nodeid)] = tests.get(file_of(nodeid), 0) + 1
    return sum(KNOWN_SECONDS.get(os.path.splitext(os.path.basename(path))[0], DEFAULT_SECONDS_PER_TEST * count)
               for path, count in tests.items())


def longest_first(units: Mapping[str, Iterable[str]]) -> list[str]:
    """The units (name -> their nodeids) longest first (``unit_seconds``), ties in their order."""
    return sorted(units, key=lambda unit: -unit_seconds(units[unit]))


def make_scheduler(config: pytest.Config, log: Any, units_dir: str) -> Any:
    """A ``FileOrRayScheduling`` reading the workers' ``ray_files`` from ``units_dir`` (xdist
    imported here: the GPU machine's image has no xdist)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileOrRayScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (a unit whole in one worker; more sent to a worker with at
        most 2 tests left) with units of a file each, or ``RAY_GROUP``, dealt ``longest_first``."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self.ray_files: set[str] = set()
            self.dealt_in_order = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of_ray(nodeid, self.ray_files)

        def schedule(self) -> None:
            if self.collection is None:  # the first call: every worker has collected
                self.ray_files = read_ray_files(units_dir)
                self.config.option.loadscopereorder = False  # dealt below, not most tests first
            super().schedule()

        def _assign_work_unit(self, node: Any) -> None:
            if not self.dealt_in_order:  # the first one: the queue is whole
                self.dealt_in_order = True
                for unit in longest_first(self.workqueue):
                    self.workqueue.move_to_end(unit)
            super()._assign_work_unit(node)

    return FileOrRayScheduling(config, log)


_UNITS_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller of a ``--dist loadfile`` run (``make test``) makes the directory
    its workers report their Ray files in (``tests.xdist_order``)."""
    if config.getoption("dist", "no") == "loadfile" and not hasattr(config, "workerinput"):
        config.stash[_UNITS_DIR] = tempfile.mkdtemp(prefix="kvstrata-xdist-units-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _UNITS_DIR in config.stash:
        shutil.rmtree(config.stash[_UNITS_DIR], ignore_errors=True)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After ``item``'s own teardown (pytest's, which ran first and did not raise): if it was
    the last test of ``RAY_GROUP`` in this worker, end the session's Ray fixtures now
    (``end_ray_fixtures``), not at the session's end. (A plain ``trylast`` hook, not a
    ``wrapper=True`` one: the GPU machine's pytest may predate it, and it imports this module.)"""
    if leaves_ray_group(item, nextitem):
        end_ray_fixtures(item)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Each xdist worker of a ``--dist loadfile`` run learns where to write its Ray files."""
    if _UNITS_DIR in node.config.stash:
        node.workerinput[UNITS_DIR_KEY] = node.config.stash[_UNITS_DIR]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` (``make test``): each file whole in one worker, the files using the
    session's Ray cluster together in one, longest first (``tests.xdist_order``)."""
    return make_scheduler(config, log, config.stash[_UNITS_DIR]) if _UNITS_DIR in config.stash else None
