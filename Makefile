# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast env bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first and pinned: an unpinned spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	$(BIN)/nonstop demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist worksteal tests

# every test that starts no process (a test that starts one must be marked integration: the
# suite's conftest refuses it otherwise), in well under a minute
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not integration" tests

bench: $(STAMP)
	$(BIN)/nonstop bench crash --ranks 4 --repeat 5 --json

clean:
	rm -rf $(VENV) nonstop-runs .pytest_cache
