#!/usr/bin/env bash
# On the GPU machine: install the carried wheels (hydra-core, omegaconf, antlr4, submitit, pytest-timeout), unzip the CIFAR-10 JPEGs
# and decode them once into the cache every run then reads.
# Usage: source bench/device_setup.sh   (expects .whl/ and .carry/cifar10-jpeg.zip carried with the call)
#        NO_DATA=1 source bench/device_setup.sh   (the wheels only)
# Make .whl/ here first (pure-Python wheels of what the GPU image lacks, the versions of .venv):
#   .venv/bin/pip wheel -q --no-deps -w .whl hydra-core omegaconf==2.3.1 antlr4-python3-runtime==4.9.3 submitit \
#     hydra-submitit-launcher cloudpickle pytest-timeout
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -c "import torch, hydra; print('torch', torch.__version__, 'hydra', hydra.__version__, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name(0))"
[ "${NO_DATA:-0}" = 1 ] && return 0
mkdir -p data
[ -d data/cifar10-jpeg ] || python3 -m zipfile -e .carry/cifar10-jpeg.zip data/
python3 -c "
import os
from hydra import compose, initialize_config_dir
import src
from src.data.datasets import load_data
with initialize_config_dir(os.path.abspath('conf'), version_base='1.3'):
    cfg = compose('train', overrides=['experiment=cifar10_94', 'paths.root_dir=' + os.getcwd()])
print(len(load_data(cfg.data).train), 'train images decoded')"
