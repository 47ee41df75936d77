#!/usr/bin/env bash
# GPU call 5 of the fifth session (2026-11-26): with the last minutes of device time, ddp on 4 GPUs vs one
# (part 1 of bench/sessions/scaling.sh, ddp only). ResNet-18, bf16, channels_last, CUDA graphs, 512 img/GPU/step.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 80 --gpus 4 \
  --only 'single1-gpu,ddp4-gpu' --out "$OUT/ddp4.json" > "$OUT/ddp4.txt" 2>&1
tail -8 "$OUT/ddp4.txt"
