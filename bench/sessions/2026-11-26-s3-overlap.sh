#!/usr/bin/env bash
# GPU call 2 of the third session (2026-11-26, issue 6): the next epoch prepared while the device finishes the
# last one; can DDP overlap the all-reduce with a CUDA-graphed backward (graph split at bucket boundaries)?
# Is the second GPU as fast as the first alone? The GPU tests.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B="python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 100"
timeout 300 $B --out "$OUT/bench.json" --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt" | head -4
timeout 90 $B --out "$OUT/bench-split5.json" --only ddp2-gpu --override strategy.compile_scope=wrapper \
  --override strategy.gradient_sync=reducer --override strategy.broadcast_buffers=false --override strategy.bucket_cap_mb=5 \
  > "$OUT/bench-split5.txt" 2>&1
grep '^ddp2' "$OUT/bench-split5.txt" | tail -1
CUDA_VISIBLE_DEVICES=1 timeout 60 $B --out "$OUT/bench-gpu1.json" --only single1-gpu > "$OUT/bench-gpu1.txt" 2>&1
grep '^single1' "$OUT/bench-gpu1.txt" | tail -1
P="--warmup 15 --windows 5 --steps 20 --tag s3b"
timeout 120 torchrun --nproc-per-node 2 bench/ddp_probe.py $P \
  --modes cudagraphs-after-backward,cudagraphs-wrapper-split-b10,cudagraphs-wrapper-split-b5 > "$OUT/probe.jsonl" 2> "$OUT/probe.err"
cut -c1-200 "$OUT/probe.jsonl"
timeout 150 python3 -m pytest -q tests/test_gpu.py -p no:cacheprovider > "$OUT/pytest-gpu.txt" 2>&1
tail -4 "$OUT/pytest-gpu.txt"
