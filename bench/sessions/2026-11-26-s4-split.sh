#!/usr/bin/env bash
# GPU call 3 of the fourth session (2026-11-26, issue 6): call 2 found the ddp step's extra time is the
# gradient sync (0.34-0.42 ms on the device: cat + 0.175 ms all-reduce + stream hops) plus GPU 1 being ~1 %
# slower. Can a graph cut right after layer4's backward (75 % of the gradient bytes) hide most of the
# all-reduce? And do 32 NCCL channels help in the loop?
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="--warmup 15 --windows 5 --steps 20 --tag s4c"
timeout 200 torchrun --nproc-per-node 2 bench/ddp_probe.py $P \
  --modes cudagraphs-after-backward,cudagraphs-wrapper-split,cudagraphs-wrapper-split-b35,cudagraphs-wrapper-split-b40 \
  2> "$OUT/probe2.err" | cut -c1-200
B="python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90"
timeout 200 $B --out "$OUT/bench.json" --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt" | head -4
timeout 80 $B --out "$OUT/bench-split35.json" --only ddp2-gpu --override strategy.compile_scope=wrapper \
  --override strategy.gradient_sync=reducer --override strategy.broadcast_buffers=false --override strategy.bucket_cap_mb=35 \
  > "$OUT/bench-split35.txt" 2>&1
grep -E '^ddp2|FAIL' "$OUT/bench-split35.txt" | tail -1
NCCL_MIN_NCHANNELS=32 timeout 70 $B --out "$OUT/bench-ch32.json" --only ddp2-gpu > "$OUT/bench-ch32.txt" 2>&1
grep -E '^ddp2|FAIL' "$OUT/bench-ch32.txt" | tail -1
