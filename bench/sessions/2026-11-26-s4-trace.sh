#!/usr/bin/env bash
# GPU call 4 of the fourth session (2026-11-26, issue 6): the gradient sync packs into a persistent flat buffer
# with one foreach copy instead of a fresh torch.cat each step: is the sync shorter (probe, both packings,
# device timeline of a step's end on each rank), and does the loop reach 1.9x?
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="--warmup 15 --windows 5 --steps 20 --tag s4d --segments"
timeout 60 torchrun --nproc-per-node 2 bench/ddp_probe.py $P --trace --modes cudagraphs-after-backward \
  > "$OUT/trace.txt" 2> "$OUT/probe2.err"
timeout 60 torchrun --nproc-per-node 2 bench/ddp_probe.py $P --modes cudagraphs-after-backward-cat,cudagraphs-after-backward 2>> "$OUT/probe2.err" | cut -c1-400
grep '^{' "$OUT/trace.txt" | cut -c1-400
B="python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90"
timeout 150 $B --out "$OUT/bench.json" --only 'single1-gpu,ddp2-gpu' > "$OUT/bench.txt" 2>&1
tail -7 "$OUT/bench.txt" | head -3
NCCL_MIN_NCHANNELS=32 timeout 70 $B --out "$OUT/bench-ch32.json" --only ddp2-gpu > "$OUT/bench-ch32.txt" 2>&1
grep -E '^ddp2|FAIL' "$OUT/bench-ch32.txt" | tail -1
