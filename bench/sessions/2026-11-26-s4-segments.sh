#!/usr/bin/env bash
# GPU call 2 of the fourth session (2026-11-26, issue 6): the CUDA loader test with the normalization lookup on
# every non-CPU device; where the ddp step's extra ~0.4 ms goes (device vs host time of forward, backward,
# gradient sync and optimizer, one GPU vs each of two ranks); the speed table with the cheaper packing.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "loader_augments" 2>&1 | tail -2
P="--warmup 15 --windows 5 --steps 20 --tag s4b --segments"
timeout 60 torchrun --nproc-per-node 1 bench/ddp_probe.py $P --modes compile-module-cudagraphs 2>"$OUT/probe1.err"
timeout 120 torchrun --nproc-per-node 2 bench/ddp_probe.py $P --modes cudagraphs-after-backward,cudagraphs-after-backward-bf16 \
  2> "$OUT/probe2.err"
timeout 230 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90 --out "$OUT/bench.json" \
  --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt" | head -4
