#!/usr/bin/env bash
# Issue 7 (not yet run): ddp/fsdp scaling on every GPU of one host, a simulated two-node job, and time to
# accuracy on N GPUs. On a 4- or 8-GPU device machine, from the repo root:  bash bench/sessions/scaling.sh
set -u
source bench/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
N=$(nvidia-smi -L | wc -l)
# 1. images/s of single and ddp/fsdp on 2..N GPUs, 512 images per GPU per step (ResNet-18, CUDA graphs for ddp)
timeout 420 python3 bench/bench.py --data-root data/cifar10-jpeg --epochs 3 --timeout 90 --gpus "$N" \
  --only 'ceiling-bf16-cl-cudagraphs,single1-gpu,ddp*-gpu,fsdp*-gpu' --out "$OUT/scaling.json" > "$OUT/scaling.txt" 2>&1
tail -14 "$OUT/scaling.txt"
# 2. a simulated two-node job on one host: two torchrun groups of N/2 ranks each, --nnodes=2
H=$((N / 2))
common="model=resnet18 data=imagefolder data.root=data/cifar10-jpeg data.val_fraction=0 data.loader=gpu strategy=ddp
  data.batch_size=$((512 * N)) trainer.max_epochs=3 trainer.amp=true trainer.channels_last=true trainer.compile=true
  trainer.compile_mode=reduce-overhead trainer.progress_bar=false hydra.run.dir=/tmp/two-nodes"
for node in 0 1; do
  CUDA_VISIBLE_DEVICES=$(seq -s, $((node * H)) $((node * H + H - 1))) timeout 200 torchrun --nnodes=2 --node-rank=$node \
    --nproc-per-node=$H --rdzv-backend=c10d --rdzv-endpoint=localhost:29700 --rdzv-id=twonodes train.py $common \
    > "$OUT/two-nodes-$node.log" 2>&1 &
done
wait
grep -h "img/s" "$OUT"/two-nodes-0.log | tail -2
# 3. time to accuracy with N GPUs, same global batch as one GPU (the cifar10_94 recipe)
timeout 150 python3 train.py experiment=cifar10_94 strategy=ddp trainer.devices="$N" hydra.run.dir=/tmp/t94-n > "$OUT/t94-${N}gpu.log" 2>&1
cp /tmp/t94-n/metrics.json "$OUT/t94-${N}gpu.json"; tail -n 2 "$OUT/t94-${N}gpu.log" | cut -c1-250
