# All set-up happens here: a fresh machine with Python 3.11 needs only `make demo` / `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv demo test test-fast lint bench clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)  ## cold then warm start of a small GPT, in two fresh processes
	$(PY) examples/quickstart.py

test: $(STAMP)  ## the whole suite, the torchair-on-CPU harness included
	TCB_REQUIRE_TORCHAIR=$${TCB_REQUIRE_TORCHAIR:-0} $(PY) -m pytest -q --timeout=900 tests

test-fast: $(STAMP)  ## without the real-torchair tests
	$(PY) -m pytest -q --timeout=900 tests --ignore=tests/torchair

lint: $(STAMP)
	$(PY) -m ruff check torchair_cached_backend tests benchmarks examples

bench: $(STAMP)  ## warm-start and per-call benchmarks, JSON/markdown/PNG in benchmarks/results/
	$(PY) benchmarks/warm_start.py --models mlp,gpt,gpt16 --repeat 5
	$(PY) benchmarks/per_call.py

clean:
	rm -rf build .torchair_cache benchmarks/results/*.json
