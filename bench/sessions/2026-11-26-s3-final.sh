#!/usr/bin/env bash
# GPU call 3 of the third session (2026-11-26, issue 6): the GPU tests of the new paths, time to accuracy
# with the compiled objective/augmentation (one GPU cold and warm compile cache, two GPUs), and ddp x2 with
# the bf16 gradient all-reduce (opt-in, less exact) for the record.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 210 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "reduce-overhead or loader_augments" 2>&1 | tail -4
for run in 1gpu-cold:1 1gpu-warm:1 2gpu:2; do
  name=${run%%:*}; n=${run##*:}
  extra=""; [ "$n" = 2 ] && extra="strategy=ddp trainer.devices=2"
  timeout 100 python3 train.py experiment=cifar10_94 $extra hydra.run.dir=/tmp/t94-$name > /tmp/t94-$name.log 2>&1
  cp /tmp/t94-$name/metrics.json "$OUT/t94-$name.json"
  echo "== $name"; grep -E "epoch 40/40|test loss" /tmp/t94-$name.log | cut -c1-260
done
timeout 90 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 85 --out "$OUT/bench-bf16hook.json" \
  --only ddp2-gpu --override strategy.comm_hook=bf16 2>&1 | grep -E '^ddp2|FAIL'
