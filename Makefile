# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast env compiled bench clean

$(STAMP): pyproject.toml bench/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the benchmarks and soaks beside the package (nonstop bench, nonstop chaos): a distribution
	# of their own, not in the wheel
	$(BIN)/pip install -q --no-deps -e bench
	touch $(STAMP)

env: $(STAMP)

demo: compiled
	$(BIN)/nonstop demo

# nonstop's own modules compiled once (where the environment forbids writing bytecode, every
# process of a job compiled what it imported again: a third of a host agent's start)
compiled: $(STAMP)
	$(BIN)/python -m compileall -q src bench

test: compiled
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests

# every test that starts no process (a test that starts one must be marked integration: the
# suite's conftest refuses it otherwise), in well under a minute
test-fast: compiled
	$(BIN)/python -m pytest -q -n 2 -m "not integration" tests

bench: $(STAMP)
	$(BIN)/nonstop bench crash --ranks 4 --repeat 5 --json

clean:
	rm -rf $(VENV) nonstop-runs .pytest_cache
