#!/usr/bin/env bash
# GPU call 4 of the third session (2026-11-26, issue 6): normalization as a lookup table (compiled == eager on
# CUDA, bit for bit), then the speed table of the final code in one call.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "loader_augments" 2>&1 | tail -2
timeout 200 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90 --out "$OUT/bench.json" \
  --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' 2>&1 | tail -7 | head -4
