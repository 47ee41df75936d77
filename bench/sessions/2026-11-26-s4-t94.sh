#!/usr/bin/env bash
# GPU call 6 of the fourth session (2026-11-26, issue 6): time to accuracy on two GPUs with the final code
# (call 5's runs had a 45 s limit, too short for a cold compile cache).
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 130 python3 train.py experiment=cifar10_94 strategy=ddp trainer.devices=2 hydra.run.dir=/tmp/t94 > "$OUT/t94-2gpu.log" 2>&1
echo "rc $?"; cp /tmp/t94/metrics.json "$OUT/t94-2gpu-cold.json"
grep -E "epoch (1|40)/40" "$OUT/t94-2gpu.log" | cut -c1-220; tail -3 "$OUT/t94-2gpu.log" | cut -c1-300
