"""The `optim/` and `scheduler/` groups. Schedules are stepped once per optimizer step."""

from __future__ import annotations

import math
from typing import Annotated

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.config.schema import NonNegative, Range


def param_groups(model: nn.Module, weight_decay: float, decay_norm_and_bias: bool) -> list[dict]:
    if decay_norm_and_bias:
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay}]
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)  # 1-d: biases and norm scales/shifts
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg: DictConfig, model: nn.Module, fused: bool = False) -> torch.optim.Optimizer:
    cfg = OmegaConf.to_container(cfg, resolve=True)
    groups = param_groups(model, cfg.get("weight_decay", 0.0), cfg.pop("decay_norm_and_bias", True))
    extra = {"fused": True} if fused else {}
    return instantiate(cfg)(groups, **extra)


def _lambda(optimizer, fn) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


class _Cosine:
    def __init__(self, total: int, warmup: int, min_ratio: float):
        self.total, self.warmup, self.min_ratio = total, warmup, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * t))


class _OneCycle:
    def __init__(self, total: int, peak: int):
        self.total, self.peak = total, max(1, peak)

    def __call__(self, step: int) -> float:
        if step < self.peak:
            return (step + 1) / self.peak
        return max(0.0, (self.total - step) / max(1, self.total - self.peak))


def warmup_cosine(
    optimizer,
    total_steps: int,
    steps_per_epoch: int,
    warmup_epochs: Annotated[float, NonNegative] = 0,
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.0,
):
    return _lambda(optimizer, _Cosine(total_steps, int(warmup_epochs * steps_per_epoch), min_lr_ratio))


def one_cycle(
    optimizer,
    total_steps: int,
    steps_per_epoch: int,
    pct_start: Annotated[float, Range(0, 1, open_lo=True, open_hi=True)] = 0.25,
):
    return _lambda(optimizer, _OneCycle(total_steps, int(pct_start * total_steps)))


def constant(optimizer, total_steps: int, steps_per_epoch: int):
    return _lambda(optimizer, lambda step: 1.0)
