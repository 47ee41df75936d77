#!/usr/bin/env bash
# GPU call 3 of 2026-11-26 (issue 6): the numbers for the README, on the chosen settings
# (CUDA graphs for single/ddp, clocks started together across ranks, experiment=cifar10_94 = ResNet-9 recipe).
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 1. time to accuracy, alone on the machine: one GPU, then two
timeout 100 python3 train.py experiment=cifar10_94 hydra.run.dir=/tmp/t94-1 > "$OUT/t94-1gpu.log" 2>&1
timeout 110 python3 train.py experiment=cifar10_94 strategy=ddp trainer.devices=2 hydra.run.dir=/tmp/t94-2 > "$OUT/t94-2gpu.log" 2>&1
cp /tmp/t94-1/metrics.json "$OUT/t94-1gpu.json"; cp /tmp/t94-2/metrics.json "$OUT/t94-2gpu.json"
tail -2 "$OUT/t94-1gpu.log" "$OUT/t94-2gpu.log" | cut -c1-250
# 2. the speed table (512 images per GPU per step, CIFAR-10 JPEGs, ResNet-18)
timeout 330 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 120 --out "$OUT/bench.json" \
  --only 'ceiling-bf16-cl-compile,ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu,single1-classic8,fsdp2-gpu,dp2-gpu' \
  > "$OUT/bench.txt" 2>&1
tail -14 "$OUT/bench.txt"
# 3. the GPU tests
timeout 150 python3 -m pytest -q tests/test_gpu.py tests/test_strategies.py::test_ddp_sync_bn_matches_single_with_batchnorm -p no:cacheprovider > "$OUT/pytest-gpu.txt" 2>&1
tail -3 "$OUT/pytest-gpu.txt"
