"""The one-process strategies: `Single` (one device) and `DataParallel` (one process, several GPUs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from src.config.errors import ConfigError
from src.strategies.base import Strategy


@dataclass
class Single(Strategy):
    """One process, one device: the base behaviour as it is."""


@dataclass
class DataParallel(Strategy):
    """torch.nn.DataParallel: one process drives trainer.devices GPUs."""

    name: ClassVar[str] = "dp"
    cuda_graphs: ClassVar[bool] = False
    # cuDNN keeps its tuned plans per thread and DataParallel runs every step in new threads, so benchmark
    # mode would re-tune all convolutions at each step (measured: 50x slower)
    cudnn_benchmark: ClassVar[bool] = False

    def processes(self, requested, available, device_type, launched, launched_local):
        if device_type != "cuda":
            raise ConfigError(
                "strategy=dp (nn.DataParallel) needs CUDA GPUs and none is in use; "
                "HINT: use strategy=ddp trainer.devices=2 for multi-process training on CPU"
            )
        if launched not in (None, 1):
            raise ConfigError(
                f"strategy=dp runs one process but the launcher started {launched}; "
                f"HINT: use strategy=ddp, or launch 1 task"
            )
        n = available if requested == "auto" else requested
        if n > available:
            raise ConfigError(f"trainer.devices={n} but only {available} GPU(s) are visible; lower trainer.devices")
        return 1, n

    def wrap(self, model, ctx):
        self.core, self.wrapper = model, nn.DataParallel(model, device_ids=list(range(ctx.devices_per_process)))
        self.model = ctx.compiled(self.wrapper)
        return self.model

    def eval_module(self):
        return self.wrapper
