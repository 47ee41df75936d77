#!/usr/bin/env bash
# GPU call 5 of the fourth session (2026-11-26, issue 6): the final code. The GPU tests of compiled ddp with
# CUDA graphs (reducer and after_backward, now with the persistent flat buffer) and the loader; the speed
# table again; time to accuracy on two GPUs, cold then warm compile cache.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "reduce-overhead or loader_augments" 2>&1 | tail -2
timeout 150 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 60 --out "$OUT/bench.json" \
  --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt" | head -4
for name in 2gpu-cold 2gpu-warm; do
  timeout 45 python3 train.py experiment=cifar10_94 strategy=ddp trainer.devices=2 hydra.run.dir=/tmp/t94-$name \
    > /tmp/t94-$name.log 2>&1
  cp /tmp/t94-$name/metrics.json "$OUT/t94-$name.json"
  echo "== $name"; grep -E "epoch 40/40" /tmp/t94-$name.log | cut -c1-200
done
