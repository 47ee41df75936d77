#!/usr/bin/env bash
# GPU call 2 of 2026-11-26 (issue 6). Call 1 found NVLink (NV18, 45 MB all-reduce in 0.17 ms) yet DDP x2
# at 0.92-1.2x one GPU, and the single-GPU loop CPU-bound (GPU 83% busy, ~220 kernel launches/step).
# Here: (1) do two independent one-GPU processes slow each other down (host-side contention)?
# (2) do CUDA graphs (torch.compile mode=reduce-overhead) fix it, in the probe and in the real loop?
# (3) longer recipes: where does accuracy saturate on the JPEGs?
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=eager,compile-module,compile-module-cudagraphs
P="--windows 5 --steps 20"
CUDA_VISIBLE_DEVICES=0 timeout 120 torchrun --nproc-per-node 1 --master-port 29600 bench/ddp_probe.py --modes $M $P --tag alone >> "$OUT/probe.jsonl" 2>> "$OUT/probe.err"
CUDA_VISIBLE_DEVICES=0 timeout 120 torchrun --nproc-per-node 1 --master-port 29601 bench/ddp_probe.py --modes $M $P --tag pair-gpu0 >> "$OUT/probe.jsonl" 2>> "$OUT/probe.err" &
CUDA_VISIBLE_DEVICES=1 timeout 120 torchrun --nproc-per-node 1 --master-port 29602 bench/ddp_probe.py --modes $M $P --tag pair-gpu1 >> "$OUT/probe.jsonl" 2>> "$OUT/probe.err" &
wait
timeout 120 torchrun --nproc-per-node 2 --master-port 29603 bench/ddp_probe.py --modes $M $P --tag ddp >> "$OUT/probe.jsonl" 2>> "$OUT/probe.err"
cat "$OUT/probe.jsonl"
# the real loop (train.py), 3 epochs, 512 images per GPU per step, images/s of epochs 2-3
for mode in default reduce-overhead; do
  for g in 1 2; do
    s=$([ $g = 1 ] && echo single || echo ddp)
    timeout 110 python3 train.py model=resnet18 data=imagefolder data.root=data/cifar10-jpeg data.val_fraction=0 \
      data.batch_size=$((512 * g)) data.loader=gpu strategy=$s trainer.devices=$g trainer.max_epochs=3 trainer.amp=true \
      trainer.channels_last=true trainer.compile=true trainer.compile_mode=$mode trainer.progress_bar=false \
      hydra.run.dir=/tmp/loop-$mode-$g > "$OUT/loop-$mode-$g.log" 2>&1
    python3 -c "import json; m=json.load(open('/tmp/loop-$mode-$g/metrics.json')); print('loop $mode x$g', round(m['final']['images_per_sec']), 'img/s, wait', round(m['final']['data_wait_fraction'],3))" || tail -5 "$OUT/loop-$mode-$g.log"
  done
done
# longer recipes, 2 at a time per GPU (accuracies only)
timeout 200 python3 bench/recipe_search.py --out /tmp/search --per-gpu 2 \
  'r9-e60: model=resnet9 trainer.max_epochs=60 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r9-e80: model=resnet9 trainer.max_epochs=80 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r18-e60: trainer.max_epochs=60 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true' \
  'r9w96-e50: model=resnet9 model.width=96 trainer.max_epochs=50 trainer.label_smoothing=0.2 data.cutout=8 trainer.flip_tta=true'
cp /tmp/search/summary.json "$OUT/search-long.json" 2>/dev/null
