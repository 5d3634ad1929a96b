# Two entry points for a fresh clone with only python3: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardkit-installed

.PHONY: install demo test lint typecheck unit bench clean gpu-check

# torch is installed first and pinned: a looser requirement with no torch present pulls CUDA wheels.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,lightning,examples,plan]"
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/shardkit demo

lint: install
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples

typecheck: install
	$(VENV)/bin/mypy

# Two pytest workers (pytest-xdist), a test file per worker at a time: most tests wait on the processes they
# start, so two files at once keep the 2-core machine busy (885 s -> 643 s measured). TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 2
test: lint typecheck
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The fast tests only: no processes, no process group (markers set by tests/testkit/speeds.py).
unit: install
	$(PY) -m pytest -q -m unit tests

bench: install
	$(VENV)/bin/shardkit bench

# On a lent GPU machine (offline, its own torch): the prepared check, under 7 minutes, writing exactly two files to
# $$OUT (or ./gpu_check_out): gpu_check.json (every check's verdict, rewritten as the run goes) and gpu_check.log.
# Without make: cd src && python3 -m shardkit.bench.gpu_check --out "$$OUT". Rerun failing parts with --parts.
# Exits non-zero when a check fails, or when this machine shows no CUDA (a GPU is expected unless --small/--dry-run).
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=$(CURDIR)/src $(GPU_PY) -m shardkit.bench.gpu_check --out "$${OUT:-gpu_check_out}"

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
