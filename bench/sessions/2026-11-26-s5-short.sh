#!/usr/bin/env bash
# GPU call 2 of the fifth session (2026-11-26, issue 6): call 1 found translate TTA worth +0.3 points and
# cutout 16 with label smoothing 0.1 better than cutout 8 with 0.2 on a 200-epoch ResNet-18 (93.83 vs 93.00);
# do those settings pay on short schedules, and how do wider ResNet-9s and ResNet-18 trade time for accuracy?
# Three runs share each GPU (accuracies only). The GPU tests run beside them on GPUs 0 and 1.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(CUDA_VISIBLE_DEVICES=0,1 timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  "tests/test_strategies.py::test_ddp_sync_bn_matches_single_with_batchnorm" > "$OUT/gpu-tests.txt" 2>&1; echo "rc $?" >> "$OUT/gpu-tests.txt") &
T="trainer.tta_shift=1"; C="data.cutout=16 trainer.label_smoothing=0.1"
timeout 450 python3 bench/recipe_search.py --out /tmp/search --per-gpu 3 --time-limit 400 \
  "r9-e40-cut16-ls1: $T $C" \
  "r9-e40-cut12-ls1: $T data.cutout=12 trainer.label_smoothing=0.1" \
  "r9-e40-cut8-ls1: $T trainer.label_smoothing=0.1" \
  "r9-e40-cut16-ls2: $T data.cutout=16" \
  "r9-e60-cut16-ls1: $T $C trainer.max_epochs=60" \
  "r9-e30-cut16-ls1: $T $C trainer.max_epochs=30" \
  "r9w96-e40-cut16-ls1: $T $C model.width=96" \
  "r9w128-e40-cut16-ls1: $T $C model.width=128" \
  "r9w128-e60-cut16-ls1: $T $C model.width=128 trainer.max_epochs=60" \
  "r18-e60-cut16-ls1: $T $C model=resnet18 trainer.max_epochs=60" \
  "r18-e40-cut16-ls1: $T $C model=resnet18" \
  "r9w96-e60-cut16-ls1: $T $C model.width=96 trainer.max_epochs=60" \
  | tee "$OUT/search.txt"
wait
cp /tmp/search/summary.json "$OUT/search-summary.json"
tar czf "$OUT/search-logs.tgz" -C /tmp/search $(cd /tmp/search && ls *.log)
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 >> "$OUT/search.txt"
tail -5 "$OUT/gpu-tests.txt"
