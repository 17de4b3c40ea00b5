# All set-up happens here: a fresh machine with Python 3.11 needs only `make demo` / `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed

BENCH_MODELS ?= mlp,gpt,gpt16
BENCH_REPEAT ?= 5
# test files run on this many workers (pytest-xdist), one file per worker: module-scoped cold caches stay shared
TEST_WORKERS ?= 2
# torch's intra-op threads per test process: the workers and their subprocesses already fill the cores (with
# torch's default, one thread a core, two workers' processes oversubscribe the 2 cores)
TEST_THREADS ?= 1

.PHONY: venv demo test test-fast lint redis bench bench-smoke bench-torchair bench-fleet bench-models bench-training bench-remote bench-scale clean

$(STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)  ## cold then warm start of a small GPT, in two fresh processes
	$(PY) examples/quickstart.py

redis:  ## redis-server for the remote-tier tests (the distribution's package; CI requires it: TCB_REQUIRE_REDIS=1)
	@if command -v redis-server >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get install -y -q redis-server >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null); \
	elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
		sudo apt-get install -y -q redis-server >/dev/null || (sudo apt-get update -q >/dev/null && sudo apt-get install -y -q redis-server >/dev/null); \
	else echo "redis-server not found and cannot be installed here: the remote-tier tests will skip (install redis-server)"; fi

test: $(STAMP) redis  ## the whole suite, the torchair-on-CPU harness and the real-Redis tests included
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)} TCB_REQUIRE_TORCHAIR=$${TCB_REQUIRE_TORCHAIR:-0} $(PY) -m pytest -q --timeout=900 -n $(TEST_WORKERS) --dist loadfile --durations=15 tests

test-fast: $(STAMP)  ## without the real-torchair tests
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-$(TEST_THREADS)} $(PY) -m pytest -q --timeout=900 tests --ignore=tests/torchair

lint: $(STAMP)
	$(PY) -m ruff check torchair_cached_backend tests benchmarks examples

bench: $(STAMP)  ## warm start (one fresh process per measurement) + per-call cost -> benchmarks/results/
	$(PY) benchmarks/warm_start.py --models $(BENCH_MODELS) --repeat $(BENCH_REPEAT)
	$(PY) benchmarks/per_call.py

bench-smoke: $(STAMP)  ## quick check of the benchmark scripts (~4 min)
	$(PY) benchmarks/warm_start.py --models mlp --repeat 1 --out /tmp/tcb_bench/warm_start.json
	$(PY) benchmarks/per_call.py --models mlp --rounds 5 --out /tmp/tcb_bench/per_call.json

bench-torchair: $(STAMP)  ## ours vs torchair's own cache_compile, real torchair on CPU over CANN stubs
	$(PY) benchmarks/torchair_warm_start.py --repeat $(BENCH_REPEAT)

bench-fleet: $(STAMP)  ## bundle round trip and torchrun ranks sharing compiles (GPT, Inductor) -> benchmarks/results/
	$(PY) benchmarks/bundle_roundtrip.py
	$(PY) benchmarks/ranks.py

bench-remote: $(STAMP) redis  ## a fresh node's first call from a local cache / Redis / cold; 8 nodes on one empty remote
	$(PY) benchmarks/remote.py

bench-models: $(STAMP)  ## transformers families (replayed? first call vs eager) and KV-cache decode per token
	$(PY) benchmarks/families.py
	$(PY) benchmarks/decode.py

bench-training: $(STAMP)  ## first training step (eager, torch.compile cold/warm, ours cold/warm/load) + steady step
	$(PY) benchmarks/training.py --repeat $${TRAINING_REPEAT:-1}

bench-scale: $(STAMP)  ## random-init Llama at ~150M / ~850M params (fp32, bf16): first call, TTFT, decode, RSS, disk
	$(PY) benchmarks/scale.py --repeats $(BENCH_REPEAT) $${SCALE_ARGS:-}

clean:
	rm -rf build .torchair_cache benchmarks/results/*.json
