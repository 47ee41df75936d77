#!/usr/bin/env bash
# GPU call 4 of the fifth session (2026-11-26, issue 6): what test-time augmentation is worth, measured on the
# same weights. Trains experiment=cifar10_94 for seeds 2, 4 and 42 (three runs sharing the GPU), then
# evaluates each final checkpoint (train=false) with no TTA, flip, flip + 1-pixel and flip + 2-pixel shifts.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for s in 2 4 42; do
  timeout 200 python3 train.py experiment=cifar10_94 seed=$s trainer.test_every_epoch=false \
    hydra.run.dir=/tmp/s$s > /tmp/s$s.log 2>&1 &
done
wait
for s in 2 4 42; do
  for tta in "false 0" "true 0" "true 1" "true 2"; do
    set -- $tta
    timeout 100 python3 train.py experiment=cifar10_94 train=false ckpt_path=/tmp/s$s/checkpoints/best.pt \
      trainer.compile=false trainer.flip_tta=$1 trainer.tta_shift=$2 hydra.run.dir=/tmp/e$s-$1-$2 > /tmp/e$s-$1-$2.log 2>&1 &
  done
  wait
  for tta in "false 0" "true 0" "true 1" "true 2"; do
    set -- $tta
    echo "seed $s flip_tta=$1 tta_shift=$2: $(grep -o 'test loss.*top-5 [0-9.]*%' /tmp/e$s-$1-$2.log)"
  done
done | tee "$OUT/tta.txt"
for s in 2 4 42; do grep -o "test loss.*top-5 [0-9.]*%" /tmp/s$s.log | sed "s/^/trained seed $s (compiled eval): /"; done | tee -a "$OUT/tta.txt"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee -a "$OUT/tta.txt"
