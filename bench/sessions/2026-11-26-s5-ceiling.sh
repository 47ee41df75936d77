#!/usr/bin/env bash
# GPU call 1 of the fifth session (2026-11-26, issue 6): how high can accuracy go on the CIFAR-10 JPEGs?
# Long ResNet-18 / wide ResNet-9 runs (the ceiling of these recipes on this data) beside 40-epoch ResNet-9
# runs that add reflect padding (data.pad_mode) and translate test-time augmentation (trainer.tta_shift).
# Every run: experiment=cifar10_94 plus the overrides shown; three runs share each GPU (accuracies only).
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R="data.pad_mode=reflect"; T="trainer.tta_shift=1"; Q="trainer.test_every_epoch=false"
timeout 450 python3 bench/recipe_search.py --out /tmp/search --per-gpu 3 --time-limit 420 \
  "r18-e200-refl-tta1: model=resnet18 trainer.max_epochs=200 $R $T $Q" \
  "r9-e40-base: " \
  "r9-e40-refl: $R" \
  "r18-e200-refl-tta1-cut16-ls1: model=resnet18 trainer.max_epochs=200 data.cutout=16 trainer.label_smoothing=0.1 $R $T $Q" \
  "r9-e40-tta1: $T" \
  "r9-e40-refl-tta1: $R $T" \
  "r9w128-e100-refl-tta1: model.width=128 trainer.max_epochs=100 $R $T $Q" \
  "r9-e40-refl-tta2: $R trainer.tta_shift=2" \
  "r9w96-e50-refl-tta1: model.width=96 trainer.max_epochs=50 $R $T" \
  "r18-e100-refl-tta1: model=resnet18 trainer.max_epochs=100 $R $T $Q" \
  "r9-e100-refl-tta1: trainer.max_epochs=100 $R $T" \
  "r9-e80-refl-tta1: trainer.max_epochs=80 $R $T" \
  | tee "$OUT/search.txt"
cp /tmp/search/summary.json "$OUT/search-summary.json"
tar czf "$OUT/search-logs.tgz" -C /tmp/search $(cd /tmp/search && ls *.log)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> "$OUT/search.txt"
