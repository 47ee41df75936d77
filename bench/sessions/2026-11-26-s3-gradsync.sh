#!/usr/bin/env bash
# GPU call 1 of the third session (2026-11-26, issue 6): the compiled objective and augmentation, and
# ddp's gradient_sync=after_backward (one flat all-reduce after the CUDA-graphed backward) vs DDP's reducer.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# 1. the speed table: ceiling (now with the shared compiled objective), single and ddp x2 (gradient_sync=auto
#    = after_backward with CUDA graphs), then ddp x2 with DDP's reducer, in the same call
timeout 330 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 110 --out "$OUT/bench.json" \
  --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt"
timeout 100 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90 --out "$OUT/bench-reducer.json" \
  --only 'ddp2-gpu' --override strategy.gradient_sync=reducer > "$OUT/bench-reducer.txt" 2>&1
tail -4 "$OUT/bench-reducer.txt" | head -2
# 2. the step-level probe: one GPU, then the DDP variants on two
P="--warmup 15 --windows 5 --steps 20"
timeout 60 torchrun --nproc-per-node 1 bench/ddp_probe.py $P --modes compile-module-cudagraphs --tag s3 > "$OUT/probe.jsonl" 2> "$OUT/probe1.err"
timeout 150 torchrun --nproc-per-node 2 bench/ddp_probe.py $P --tag s3 \
  --modes compile-module-cudagraphs,cudagraphs-nobcast,cudagraphs-nobcast-1bucket,cudagraphs-after-backward,cudagraphs-after-backward-bf16,cudagraphs-wrapper-split \
  >> "$OUT/probe.jsonl" 2> "$OUT/probe2.err"
cat "$OUT/probe.jsonl" | cut -c1-200; tail -3 "$OUT/probe2.err"
