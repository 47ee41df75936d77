# ddplab — `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
SWEEP  ?=

.PHONY: help install train test test-fast lint format report tensorboard bench bench-strategies bench-data bench-decode bench-decode-cpus bench-dali bench-dali-engine bench-airbench bench-fsdp-graph bench-fsdp-small slurm-install clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-18s %s\n", $$1, $$2}'

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	bash .ci/install.sh $(VENV)
	touch $@

install: $(VENV)/.installed  ## create/reuse .venv and install requirements.txt

train: install  ## train with the default config (digits, CPU or GPU); pass overrides as ARGS="strategy=ddp ..."
	$(PY) train.py $(ARGS)

TEST_WORKERS ?= 2
test: install slurm-install lint  ## install, lint, then the whole test suite (CPU; SLURM tests skip where slurm can't be installed)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope $(ARGS)

lint: install  ## ruff (lint and format check) and import-linter (no cycles, layers), all in pyproject.toml
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

format: install  ## ruff: fix what can be fixed and format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-fast: install  ## tests without the multi-process and SLURM ones
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope -m "not slow and not slurm" $(ARGS)

report: install  ## results table of SWEEP=multirun/<date>/<time> (default: the newest sweep with results)
	$(PY) -m src.reporting.report $(SWEEP)

tensorboard: install  ## TensorBoard over outputs/ and multirun/ (or LOGDIR=/SWEEP=...) on PORT (default 6006)
	$(VENV)/bin/tensorboard $(if $(or $(LOGDIR),$(SWEEP)),--logdir $(or $(LOGDIR),$(SWEEP)),\
	--logdir_spec outputs:outputs,multirun:multirun) --port $(or $(PORT),6006)

bench: install  ## speed benchmark (GPU); ARGS="--smoke" runs the tiny CPU mode
	$(PY) bench/bench.py $(ARGS)

MODEL ?= resnet50
bench-strategies: install  ## single, ddp, fsdp on 2 and 4 GPUs, compiled, one table (GPU): MODEL=resnet50|vit_b16|resnet18
	$(PY) bench/strategies_table.py --scaling $(MODEL) $(ARGS)

GPUS ?= 1
DALI_HW ?= 0
bench-dali: install  ## NVIDIA DALI's ResNet-50 pipeline in the ceiling's step (GPU): SHARDS=<pack> GPUS=1|4 DALI_HW=0|default
	$(PY) bench/dali_anchor.py --gpus $(GPUS) --shards $(SHARDS) --mode loop \
		$(if $(filter-out default,$(DALI_HW)),--hw-decoder-load $(DALI_HW)) --out outputs/bench/dali-loop$(GPUS)-hw$(DALI_HW).json $(ARGS)

# ResNet-50's loop from a pack of JPEGs, as every decode report times it
RESNET50_DISK = bench/bench.py --model resnet50 --image-size 224 --batch 256 --shards $(SHARDS) --epochs 3 \
	--workers auto --override trainer.limit_eval_batches=2

bench-dali-engine: install  ## data.decode=dali and the default beside DALI's own pipeline, ResNet-50 on one GPU (GPU): SHARDS=<pack>
	$(MAKE) --no-print-directory bench-dali SHARDS=$(SHARDS) GPUS=1 DALI_HW=0 ARGS="--steps 300"
	$(MAKE) --no-print-directory bench-dali SHARDS=$(SHARDS) GPUS=1 DALI_HW=default ARGS="--steps 300"
	$(PY) $(RESNET50_DISK) --gpus 1 --decode dali,auto --only 'resnet50-single1-*' \
		--out outputs/bench/dali-engine.json $(ARGS)

bench-decode: install  ## the default data.decode vs each explicit choice on this host, loaders alone and ResNet-50 on 1 and GPUS GPUs (GPU): SHARDS=<pack> GPUS=4
	$(PY) $(RESNET50_DISK) --gpus $(GPUS) --decode auto,cpu,cpudecode,gpu,split,dali \
		--only 'resnet50-ceiling-bf16-cl-cudagraphs,loader*,resnet50-single1-*,resnet50-ddp$(GPUS)-*' \
		--out outputs/bench/decode$(GPUS).json $(ARGS)

CPUS ?= 8 12 14 16
bench-decode-cpus: install  ## the default data.decode beside CPU, GPU and DALI decoding, ResNet-50 on one GPU given each of CPUS CPUs (GPU, taskset): SHARDS=<pack>
	for n in $(CPUS); do taskset -c 0-$$((n - 1)) $(PY) $(RESNET50_DISK) --gpus 1 --decode auto,cpuauto,gpu,dali \
		--only 'resnet50-single1-*' --out outputs/bench/decode-cpus$$n.json $(ARGS) || exit 1; done

DATA ?= data/cifar10-jpeg
AIRBENCH_GPUS ?= 2
PRESET_EPOCHS ?= 40
DDP_EPOCHS ?= 50
SEEDS ?= 2,4,42
PRESET = experiment=cifar10_airbench data.root=$(abspath $(DATA)) trainer.test_every_epoch=false
bench-airbench: install  ## airbench96 (40, 60 epochs), then experiment=cifar10_airbench on one GPU (PRESET_EPOCHS=40) and ddp x AIRBENCH_GPUS (DDP_EPOCHS=50), SEEDS=2,4,42, on the CIFAR-10 JPEGs (GPU; pip install airbench==0.1.8): DATA=<folder>
	$(PY) bench/airbench_anchor.py --data $(DATA) --seeds $(SEEDS) --epochs 40,60 --out outputs/bench/airbench96.json $(ARGS)
	for run in "single 1 $(PRESET_EPOCHS)" "ddp $(AIRBENCH_GPUS) $(DDP_EPOCHS)"; do set -- $$run; d=outputs/bench/cifar10_airbench/$$1; \
		$(PY) train.py $(PRESET) strategy=$$1 trainer.devices=$$2 trainer.max_epochs=1 hydra.run.dir=$$d-warmup && \
		$(PY) train.py -m $(PRESET) strategy=$$1 trainer.devices=$$2 trainer.max_epochs=$$3 seed=$(SEEDS) hydra.sweep.dir=$$d 'hydra.sweep.subdir=seed$${seed}' || exit 1; done
	$(PY) -m src.reporting.report outputs/bench/cifar10_airbench/single outputs/bench/cifar10_airbench/ddp \
		--out outputs/bench/cifar10_airbench

bench-fsdp-graph: install  ## fsdp's whole step as one CUDA graph (ResNet-18, 512 per GPU) beside one GPU (GPU): FSDP_GPUS=2
	$(PY) bench/fsdp_step_graph.py --gpus $(or $(FSDP_GPUS),2) --out outputs/bench/fsdp-step-graph.json $(ARGS)

bench-fsdp-small: install  ## ResNet-18 at 512 per GPU: fsdp x2 under CUDA graphs (collectives in the graphs) beside one GPU (GPU)
	$(PY) bench/bench.py --epochs 10 --gpus 2 --only 'single1-gpu,fsdp2-gpu' --override trainer.compile_mode=reduce-overhead \
		--out outputs/bench/fsdp-small.json $(ARGS)

ZIP ?= ../shared/datasets/cifar10-jpeg.zip
MAX_SIDE ?=
SHARDS := data/imagenet-like-shards$(MAX_SIDE)
bench-data: install  ## ImageNet-like folder data/imagenet-like (50k+10k ~100 KiB JPEGs from ZIP) + its shards (MAX_SIDE=256: re-encoded, in data/imagenet-like-shards256)
	$(PY) bench/make_imagefolder.py --zip $(ZIP) --out data/imagenet-like --train 50000 --test 10000
	[ -f $(SHARDS)/meta.json ] || $(PY) -m src.data.shards pack data/imagenet-like $(SHARDS) $(if $(MAX_SIDE),--max-side $(MAX_SIDE))

slurm-install:  ## install Debian's slurm-wlm + munge + slurmdbd + mariadb for the SLURM tests (needs root + apt)
	@bash .ci/install_slurm.sh || echo "make: SLURM packages not installed; the SLURM tests will be skipped"

clean:  ## remove outputs/ and multirun/ contents (keeps .venv)
	rm -rf outputs multirun/*/
