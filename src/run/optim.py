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
    norm_lr_scale: Annotated[float, PositiveReal]


def param_groups(
    model: nn.Module,
    weight_decay: float,
    decay_norm_and_bias: bool,
    lr: float,
    scale: float = 1.0,
    head=frozenset(),
    norm_scale: float = 1.0,
) -> list[dict]:
    """The trained parameters (model.freeze leaves some out) in groups by weight decay (none on 1-d biases and norm
    scales/shifts unless decay_norm_and_bias) and learning rate: `scale` x lr for all but the `head` (names), and
    `norm_scale` x lr for BatchNorm's parameters, whose weight decay is divided by it (the same decay per step)."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in m.parameters()}
    groups = {}  # (decay, scaled, norm-scaled) -> parameters; the unscaled groups come first, as before scaling
    for name, p in model.named_parameters():
        if p.requires_grad:
            clean = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")  # compile, AC
            scaled, norm = scale != 1 and clean not in head, norm_scale != 1 and id(p) in norms
            groups.setdefault((decay_norm_and_bias or p.ndim > 1, scaled, norm), []).append(p)
    kinds = [(True, False, False)] if decay_norm_and_bias else [(True, False, False), (False, False, False)]
    kinds += [(decay, True, False) for decay, *_ in kinds if (decay, True, False) in groups]
    kinds += [(decay, scaled, True) for decay, scaled, _ in kinds if (decay, scaled, True) in groups]
    out = []
    for decay, scaled, norm in kinds:
        factor = (scale if scaled else 1) * (norm_scale if norm else 1)
        group = {"params": groups.get((decay, scaled, norm), [])}
        group["weight_decay"] = weight_decay / (norm_scale if norm else 1) if decay else 0.0
        out.append(group | ({"lr": lr * factor} if factor != 1 else {}))
    return out


def build_optimizer(cfg: DictConfig, model: nn.Module, fused: bool = False, head=frozenset()) -> torch.optim.Optimizer:
    """`head`: parameter names outside optim.pretrained_lr_scale (the classifier head of a starting point)."""
    cfg = OmegaConf.to_container(cfg, resolve=True)
    scale = cfg.pop("pretrained_lr_scale", 1.0)
    norm_scale = cfg.pop("norm_lr_scale", 1.0)
    decay_all = cfg.pop("decay_norm_and_bias", True)
    groups = param_groups(model, cfg.get("weight_decay", 0.0), decay_all, cfg["lr"], scale, head, norm_scale)
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
    def __init__(self, total: int, peak: int, start: float = 0.0, end: float = 0.0):
        self.total, self.peak, self.start, self.end = total, max(1, peak), start, end

    def __call__(self, step: int) -> float:
        if step < self.peak:
            return self.start + (1 - self.start) * (step + 1) / self.peak
        return self.end + (1 - self.end) * max(0.0, (self.total - step) / max(1, self.total - self.peak))


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
    start_ratio: Annotated[float, Range(0, 1)] = 0.0,
    end_ratio: Annotated[float, Range(0, 1)] = 0.0,
):
    return _lambda(optimizer, _OneCycle(total_steps, int(pct_start * total_steps), start_ratio, end_ratio))


def constant(optimizer, total_steps: int, steps_per_epoch: int):
    return _lambda(optimizer, lambda step: 1.0)
