"""Up-front validation of the composed config against the machine, and the sizes derived from it.

Everything here runs in the launching process before any rank starts, so a bad input costs one line
on stderr and no partial outputs. Each option's own type and range are declared in src/config/schema.py;
this module checks how options fit together and with the machine.
"""

from __future__ import annotations

import os

import torch
from omegaconf import DictConfig

from src.config import schema
from src.config.errors import ConfigError
from src.config.layout import Layout, resolve_device_type
from src.data.datasets import check_data_config
from src.run.cluster import check_keys

__all__ = ["check_types", "plan_layout"]


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_types(cfg: DictConfig) -> None:
    """Every option on its own (src/config/schema.py, the cluster and data groups' own checks), then the combinations
    that cannot work."""
    schema.check(cfg)
    check_keys(cfg.cluster)
    check_data_config(cfg.data)
    t = cfg.trainer
    cut, augment = cfg.data.get("cutout", 0), cfg.data.get("augment", "none")
    # "auto" is resolved when the images are read (the loader checks it then)
    _expect(
        not cut or augment in ("crop_flip", "auto"),
        f"data.cutout={cut} needs data.augment=crop_flip, got {augment!r}; set data.cutout=0",
    )
    # torch's CUDA-graph trees hand out each replay's gradients in memory the next replay reuses, so gradients
    # summed over micro-batches come out wrong (pytorch/pytorch#169545, #96693)
    _expect(
        t.compile_mode != "reduce-overhead" or not t.compile or t.accumulate_grad_batches == 1,
        f"trainer.compile_mode=reduce-overhead (CUDA graphs) cannot accumulate gradients over "
        f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} micro-batches (torch sums them wrongly); "
        f"use trainer.compile_mode=default or accumulate_grad_batches=1",
    )


def _available_devices(device_type: str) -> int:
    return torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)


def plan_layout(
    cfg: DictConfig, launched_world_size: int | None = None, launched_local_size: int | None = None
) -> Layout:
    """Validate the config against the machine (or the launcher that started us) and size the run.

    launched_world_size: the world size of an external launcher (torchrun, SLURM), if any.
    """
    from src.strategies import build_strategy

    check_types(cfg)
    strategy = build_strategy(cfg.strategy)
    device_type = resolve_device_type(cfg)
    strategy.check(cfg, device_type)
    world, per_process = strategy.processes(
        cfg.trainer.devices, _available_devices(device_type), device_type, launched_world_size, launched_local_size
    )
    accumulate = cfg.trainer.accumulate_grad_batches
    batch = cfg.data.batch_size
    _expect(
        batch % (world * accumulate * per_process) == 0,
        f"data.batch_size={batch} (global) is not divisible by world_size*accumulate_grad_batches*"
        f"devices_per_process={world}*{accumulate}*{per_process}; pick a multiple of "
        f"{world * accumulate * per_process}",
    )
    micro = batch // (world * accumulate)
    _expect(
        not (cfg.data.get("mixup_alpha", 0) or cfg.data.get("cutmix_alpha", 0)) or micro % 2 == 0,
        f"data.mixup_alpha/cutmix_alpha mix pairs of samples, so each process's micro-batch must be even, but "
        f"data.batch_size={batch} / (world_size {world} x accumulate {accumulate}) = {micro}; pick a multiple of "
        f"{2 * world * accumulate}",
    )
    if cfg.trainer.amp and cfg.trainer.amp_dtype == "fp16":
        _expect(device_type == "cuda", "trainer.amp_dtype=fp16 needs a CUDA GPU; use trainer.amp_dtype=bf16 on CPU")
    return Layout(strategy.name, device_type, world, per_process, accumulate, batch)
