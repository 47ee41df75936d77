#!/usr/bin/env bash
# GPU calls 6-7 of the fourth session (2026-11-26, issue 6): time to accuracy on two GPUs with the final code,
# cold then (call 7) warm compile cache (call 5's runs had a 45 s limit, too short for a cold cache).
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for name in ${T94_RUNS:-cold}; do
  timeout 75 python3 train.py experiment=cifar10_94 strategy=ddp trainer.devices=2 hydra.run.dir=/tmp/t94-$name \
    > "$OUT/t94-2gpu-$name.log" 2>&1
  echo "== $name rc $?"; cp /tmp/t94-$name/metrics.json "$OUT/t94-2gpu-$name.json"
  grep -E "epoch (1|40)/40" "$OUT/t94-2gpu-$name.log" | cut -c1-220; tail -1 "$OUT/t94-2gpu-$name.log" | cut -c1-300
done
