# Two commands on a fresh machine: `make plan` and `make test`.
# The set-up is idempotent: a stamp file records that .venv holds this
# pyproject's dependencies, so a second run costs well under 5 s.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.meshplan-installed
# Pinned exactly: on CPU machines this resolves to the local CPU wheel, on GPU
# machines to the CUDA build of the same version. Never leave torch open-ended.
TORCH_PIN := torch==2.13.0

.PHONY: setup plan test test-fast test-slow test-consumers lint bench pictures gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	@$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[dev]" "$(TORCH_PIN)"
	@touch $(STAMP)

plan: setup
	$(BIN)/meshplan plan --model 13B --gpus 16

# Tiers run fastest first, so a break shows within a couple of minutes:
# unit + cli (pure Python and CLI subprocesses), then multiproc (torchrun on
# gloo) and gpu (skipped without CUDA).
test: test-fast test-slow

test-fast: setup
	$(BIN)/python -m pytest -q --durations=10 tests/unit tests/cli

test-slow: setup
	$(BIN)/python -m pytest -q --durations=10 tests/multiproc tests/gpu

# The engines' own loaders (deepspeed, torchtitan, megatron-core, accelerate)
# check every export: a separate venv, since they pull a GB of packages the
# planner never needs. DS_BUILD_OPS=0: DeepSpeed compiles no op on install.
CVENV := .venv-consumers
CBIN := $(CVENV)/bin
CSTAMP := $(CVENV)/.meshplan-installed

$(CSTAMP): pyproject.toml
	@test -x $(CBIN)/python || $(PY) -m venv $(CVENV)
	@$(CBIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	@DS_BUILD_OPS=0 $(CBIN)/python -m pip install -q --disable-pip-version-check -e ".[dev,consumers]" "$(TORCH_PIN)"
	@touch $(CSTAMP)

# torchtitan 0.3 shares torchtitan 0.2's distribution name: its own venv, used
# by tests/consumers/test_torchtitan_03.py through its interpreter.
TVENV := .venv-consumers-tt03
TSTAMP := $(TVENV)/.meshplan-installed

$(TSTAMP): pyproject.toml
	@test -x $(TVENV)/bin/python || $(PY) -m venv $(TVENV)
	@$(TVENV)/bin/python -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	@$(TVENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[consumers-tt03]" "$(TORCH_PIN)"
	@touch $(TSTAMP)

test-consumers: $(CSTAMP) $(TSTAMP)
	MESHPLAN_TT03_PYTHON=$(abspath $(TVENV))/bin/python $(CBIN)/python -m pytest -q --durations=10 tests/consumers

lint: setup
	$(BIN)/ruff check .

bench: setup
	$(BIN)/python bench/accuracy_vtrain.py
	$(BIN)/python bench/accuracy_published.py
	$(BIN)/python bench/accuracy_dgxc.py
	$(BIN)/python bench/accuracy_holdout.py --quiet
	$(BIN)/python bench/accuracy_torchtitan_h100.py
	$(BIN)/python bench/accuracy_megatron_papers.py
	$(BIN)/python bench/accuracy_moe.py
	$(BIN)/python bench/search_speed.py --quick
	$(BIN)/python bench/validate_memory_1b.py

# The README's pictures (docs/*.png), each from the verb that draws it; the report's runs are the small
# CPU Llama of bench/closed_loop.py on 2 ranks after `calibrate --quick` (a few minutes on 2 cores).
PICS := build/pictures
SMALL := bench/data/llama_small_cpu.json
SMALL_TRAINING := --cluster cpu --gpus 2 --model $(SMALL) --seq-len 256 --global-batch 8 --micro-batch 2 \
	--recompute none --calibration $(PICS)/cpu.json

pictures: setup
	@mkdir -p $(PICS) docs
	$(BIN)/meshplan plan --model 13B --gpus 16 -o $(PICS)/13b.json --png docs/memory.png
	$(BIN)/meshplan simulate $(PICS)/13b.json --png docs/timeline.png
	$(BIN)/meshplan plan --model 70B --gpus auto --tokens 2T --price-per-gpu-hour 2.5 --png docs/scaling.png
	$(BIN)/meshplan calibrate --quick --max-ranks 2 --model $(SMALL) --seq-len 256 --micro-batch 2 \
		--out $(PICS)/cpu.json > /dev/null
	$(BIN)/meshplan plan $(SMALL_TRAINING) --dp 2 --zero 0 -o $(PICS)/ddp.json > /dev/null
	$(BIN)/meshplan plan $(SMALL_TRAINING) --dp 2 --zero 3 -o $(PICS)/zero3.json > /dev/null
	$(BIN)/meshplan plan $(SMALL_TRAINING) --tp 2 --no-sequence-parallel -o $(PICS)/tp2.json > /dev/null
	for run in ddp zero3 tp2; do \
		$(BIN)/meshplan execute $(PICS)/$$run.json --steps 10 --log-every 10 --out $(PICS)/$$run --overwrite || exit 1; \
	done
	$(BIN)/meshplan report $(PICS)/ddp $(PICS)/zero3 $(PICS)/tp2 --png docs/report.png

# One GPU, under 8 minutes: ~1B and ~8B Llamas, compile off/on, bf16/fp8, measured against the plan
# (bench/gpu_check.py; README "Measuring a GPU"). .venv's python when it exists, else the system python3
# with the repository on PYTHONPATH: a lent GPU machine without network cannot build .venv, and setup is
# not attempted here. GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--json out.json" or "--dry-run".
GPU_CHECK_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" $(GPU_CHECK_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(CVENV) $(TVENV) *.egg-info .pytest_cache
