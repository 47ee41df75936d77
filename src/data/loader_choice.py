"""Which loader a run gets (data.loader, data.decode, data.crop): one place that names the choice, above the
loaders it chooses among (src/data/loaders.py: device-resident and DataLoader-based; src/data/disk_loader.py:
images read from disk)."""

from __future__ import annotations

import logging

import torch

from src.config.errors import ConfigError
from src.data.datasets import DataBundle
from src.data.decode import EncodedImages
from src.data.decode_choice import auto_decode
from src.data.disk_loader import DiskLoader
from src.data.loaders import (
    AUTO_CPU_WORKERS,
    ClassicLoader,
    DeviceLoader,
    Recipe,
    cpus_of_this_process,
    resolve_workers,
)

log = logging.getLogger("ddplab")


def build_loader(
    data: DataBundle,
    cfg,
    device: torch.device,
    channels_last: bool,
    seed: int,
    compile: bool = False,
    local_processes: int = 1,
):
    """data.loader: gpu (device-resident), classic (DataLoader workers) or auto.
    compile (trainer.compile): compile the gpu loader's augmentation too. local_processes: the training processes
    of this node (data.num_workers=auto shares its CPUs among them)."""
    choice = cfg.get("loader", "auto")
    pad_mode = cfg.get("pad_mode", "zeros")
    trivial = cfg.get("auto_augment", "none") == "trivial"  # runs in CPU workers (src.data.augment.trivial_augment)
    if choice == "auto":
        choice = "gpu" if data.in_memory and device.type == "cuda" and not trivial else "classic"
    if choice == "gpu":
        if not data.in_memory:
            raise ConfigError(
                "data.loader=gpu needs a dataset that fits in memory; use data.loader=classic "
                "(data.decode=gpu decodes images read from disk on the GPU) or raise data.max_memory_gb"
            )
        return DeviceLoader(data, device, channels_last, seed, cfg.get("cutout", 0), compile, pad_mode, Recipe.of(cfg))
    if isinstance(data.train.files, EncodedImages):
        decode, crop = cfg.get("decode", "auto"), cfg.get("crop", "auto")
        if decode == "auto":
            workers = cfg.get("num_workers", 0)
            if workers == "auto":
                workers = max(0, min(cpus_of_this_process(local_processes) - 1, AUTO_CPU_WORKERS))
            cpu_only = "data.auto_augment=trivial" if trivial else "data.crop=workers" if crop == "workers" else None
            decode, why = auto_decode(device.type, workers, cpu_only)
            log.info("data.decode=auto: %s (%s); data.decode=cpu, gpu or split chooses", decode, why)
        decode_on_device = decode == "gpu"
        split = decode == "split"  # CPU workers decode, except each batch's GPU share; this process crops
        crop_on_device = decode_on_device or crop == "device" or split
        workers = resolve_workers(cfg.get("num_workers", 0), device, False, decode_on_device, local_processes, split)
        share = cfg.get("gpu_share", 0.5) if split else 0.0
        return DiskLoader(data, cfg, device, channels_last, seed, decode_on_device, crop_on_device, workers, share)
    workers = resolve_workers(cfg.get("num_workers", 0), device, data.in_memory, False, local_processes)
    return ClassicLoader(data, device, channels_last, workers, seed, cfg.get("cutout", 0), pad_mode, Recipe.of(cfg))
