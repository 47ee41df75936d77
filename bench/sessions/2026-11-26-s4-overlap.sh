#!/usr/bin/env bash
# GPU call 1 of the fourth session (2026-11-26, issue 6): can the gradient all-reduce overlap the CUDA-graphed
# backward (compiled autograd traces DDP's python reducer into the backward graph)? Do NCCL channel counts
# change the 44.7 MB all-reduce? And the CUDA test of the final normalization code.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "loader_augments" 2>&1 | tail -2
P="--warmup 15 --windows 5 --steps 20 --tag s4a"
timeout 60 torchrun --nproc-per-node 1 bench/ddp_probe.py $P --modes compile-module-cudagraphs 2>"$OUT/probe1.err" | cut -c1-220
timeout 260 torchrun --nproc-per-node 2 bench/ddp_probe.py $P \
  --modes cudagraphs-after-backward,cudagraphs-compiled-autograd,compiled-autograd,cudagraphs-after-backward-bf16 \
  2> "$OUT/probe2.err" | cut -c1-220
grep -iE "error|skipping cudagraphs|Traceback" "$OUT/probe2.err" | sort | uniq -c | head -12
for ch in 16 32; do
  echo "== NCCL_MIN_NCHANNELS=$ch"
  NCCL_MIN_NCHANNELS=$ch timeout 40 torchrun --nproc-per-node 2 bench/ddp_probe.py --modes "" 2>/dev/null | cut -c1-220
done
