#!/usr/bin/env bash
# GPU call 3 of the fifth session (2026-11-26, issue 6): time runs alone (one run per GPU).
# GPU 1: the most accurate recipe found (ResNet-18, 200 epochs, cutout 16, label smoothing 0.1, flip and
# translate TTA), with its curve. GPU 0, once GPU 1's compile is done: experiment=cifar10_94 (now with
# translate TTA) cold then warm compile cache, then the wide ResNet-9 (width 128, 60 epochs).
# Then both GPUs: cifar10_94 with ddp, cold and warm.
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C="data.cutout=16 trainer.label_smoothing=0.1"
run() {  # name gpus timeout overrides...
  local name=$1 gpus=$2 limit=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" python3 train.py experiment=cifar10_94 "$@" hydra.run.dir=/tmp/r-$name \
    > "/tmp/$name.log" 2>&1
  echo "== $name rc $?: $(grep -E 'epoch 1/' /tmp/$name.log | cut -c1-160)"; tail -1 "/tmp/$name.log" | cut -c1-300
  cp /tmp/r-$name/metrics.json "/tmp/json/$name.json" 2>/dev/null
}
mkdir -p /tmp/json
run r18-e200 1 300 model=resnet18 trainer.max_epochs=200 $C > "$OUT/gpu1.txt" 2>&1 &
sleep 45
run t94-1gpu-cold 0 90 > "$OUT/gpu0.txt" 2>&1
run t94-1gpu-warm 0 90 >> "$OUT/gpu0.txt" 2>&1
run r9w128-e60 0 150 model.width=128 trainer.max_epochs=60 $C >> "$OUT/gpu0.txt" 2>&1
wait
run t94-2gpu-cold 0,1 100 strategy=ddp trainer.devices=2 > "$OUT/ddp.txt" 2>&1
run t94-2gpu-warm 0,1 100 strategy=ddp trainer.devices=2 >> "$OUT/ddp.txt" 2>&1
cat "$OUT"/gpu0.txt "$OUT"/gpu1.txt "$OUT"/ddp.txt
tar czf "$OUT/metrics.tgz" -C /tmp/json .
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
