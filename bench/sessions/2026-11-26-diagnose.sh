#!/usr/bin/env bash
# GPU call 1 of 2026-11-26 (issue 6): why does DDP not scale, where does the single-GPU loop lose
# time against the ceiling, and which recipe reaches 94 % on the CIFAR-10 JPEGs?
# Run on the 2-GPU device machine from the repo root:  bash bench/sessions/2026-11-26-diagnose.sh
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> "$OUT/topo.txt"
# 1. DDP probe: fixed on-device batch, 512 per GPU
timeout 100 torchrun --nproc-per-node 1 bench/ddp_probe.py --modes eager,compile-module --windows 5 --steps 20 \
  > "$OUT/probe1.jsonl" 2> "$OUT/probe1.err"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P timeout 200 torchrun --nproc-per-node 2 bench/ddp_probe.py \
  --modes eager,eager-bf16hook,compile-module,compile-wrapper,compile-module-bf16hook --windows 5 --steps 20 \
  > "$OUT/probe2.jsonl" 2> "$OUT/probe2.err"
grep -E "via|P2P|NVLS|Connected" "$OUT/probe2.err" | head -20 > "$OUT/nccl.txt"
cat "$OUT/probe1.jsonl" "$OUT/probe2.jsonl"
# 2. profile of one steady-state epoch of the single-GPU loop (bench recipe, 512 per step)
timeout 90 python3 bench/profile_loop.py experiment=cifar10_94 trainer.test_every_epoch=false \
  --trace /tmp/trace-single.json > "$OUT/profile-single.txt" 2>&1; gzip -c /tmp/trace-single.json > "$OUT/trace-single.json.gz"
head -3 "$OUT/profile-single.txt"
# 3. recipe search: 8 recipes, 4 at a time on each GPU (accuracies comparable, times not)
timeout 330 python3 bench/recipe_search.py --out "$OUT/search" --per-gpu 4 \
  'r18-e30-tta: trainer.max_epochs=30 trainer.flip_tta=true' \
  'r18-e30-ls2-cut8-tta: trainer.max_epochs=30 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r18-e30-lr02-tta: trainer.max_epochs=30 optim.lr=0.2 trainer.flip_tta=true' \
  'r18-e40-ls2-cut8-tta: trainer.max_epochs=40 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r9-e24-ls2-cut8-tta: model=resnet9 trainer.max_epochs=24 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r9-e24-tta: model=resnet9 trainer.max_epochs=24 trainer.label_smoothing=0.2 trainer.flip_tta=true' \
  'r9-e40-ls2-cut8-tta: model=resnet9 trainer.max_epochs=40 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r9w96-e30-ls2-cut8-tta: model=resnet9 model.width=96 trainer.max_epochs=30 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true'
rm -rf "$OUT"/search/*/checkpoints
