"""The `optim/` and `scheduler/` groups: `Optim` declares the optimizer options (torch's optimizers declare
no types), each schedule's signature declares its own. Schedules are stepped once per optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from src.config.schema import Fraction, NonNegative, PositiveReal, Range


@dataclass
class Optim:
    """torch's optimizers declare no types: the options ddplab's optim/ YAMLs use, with their ranges."""

    lr: Annotated[float, PositiveReal]
    momentum: Annotated[float, Fraction]
    nesterov: bool
    weight_decay: Annotated[float, NonNegative]
    betas: list[Annotated[float, Fraction]]
    eps: Annotated[float, PositiveReal]
    decay_norm_and_bias: bool
    pretrained_lr_scale: Annotated[float, Range(0, 1, open_lo=True)]


def param_groups(
    model: nn.Module, weight_decay: float, decay_norm_and_bias: bool, lr: float, scale: float = 1.0, head=frozenset()
) -> list[dict]:
    """The trained parameters (model.freeze leaves some out) in groups by weight decay (none on 1-d biases and norm
    scales/shifts unless decay_norm_and_bias) and learning rate: `scale` x lr for all but the `head` (names)."""
    groups = {}  # (decay, scaled) -> parameters; the unscaled groups come first, as before scaling existed
    for name, p in model.named_parameters():
        if p.requires_grad:
            clean = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")  # compile, AC
            groups.setdefault((decay_norm_and_bias or p.ndim > 1, scale != 1 and clean not in head), []).append(p)
    kinds = [(True, False)] if decay_norm_and_bias else [(True, False), (False, False)]
    kinds += [(decay, True) for decay, _ in kinds if (decay, True) in groups]
    return [
        {"params": groups.get(kind, []), "weight_decay": weight_decay if kind[0] else 0.0}
        | ({"lr": lr * scale} if kind[1] else {})
        for kind in kinds
    ]


def build_optimizer(cfg: DictConfig, model: nn.Module, fused: bool = False, head=frozenset()) -> torch.optim.Optimizer:
    """`head`: parameter names outside optim.pretrained_lr_scale (the classifier head of a starting point)."""
    cfg = OmegaConf.to_container(cfg, resolve=True)
    scale = cfg.pop("pretrained_lr_scale", 1.0)
    decay_all = cfg.pop("decay_norm_and_bias", True)
    groups = param_groups(model, cfg.get("weight_decay", 0.0), decay_all, cfg["lr"], scale, head)
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
