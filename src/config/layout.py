"""The layout of a run: processes, devices and the batch each one sees, made once by src/run/plan.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from src.config.errors import ConfigError


def resolve_device_type(cfg: DictConfig) -> str:
    wanted = cfg.trainer.device
    if wanted == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu (or auto)")
        return "cuda"
    if wanted == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Layout:
    """How the work is spread: processes, devices, and the batch each one sees."""

    strategy: str
    device_type: str
    world_size: int  # processes
    devices_per_process: int  # >1 only for dp
    accumulate: int
    global_batch: int

    @property
    def micro_batch(self) -> int:
        """Samples per process per forward pass."""
        return self.global_batch // (self.world_size * self.accumulate)

    @property
    def per_device_batch(self) -> int:
        return self.micro_batch // self.devices_per_process
