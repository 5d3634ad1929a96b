# Two entry points for a fresh clone with only python3: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.shardkit-installed

.PHONY: install demo test lint typecheck unit bench clean

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

test: lint typecheck
	$(PY) -m pytest -q tests

bench: install
	$(VENV)/bin/shardkit bench

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache
