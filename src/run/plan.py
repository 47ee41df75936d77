"""Up-front validation of the composed config against the machine, and the plan of the run made from it.

The launching process runs this before any rank starts, so a bad input costs one line on stderr and no partial
outputs. Each group's options are declared once, beside the code that reads them: the groups in `DECLARED`,
`Top` here, `ModelStart` (src/models.py), the signature of each `_target_` (model, scheduler, strategy, logger),
and the cluster and data groups' own checks. `check_types` collects them all, then checks how options fit
together; `plan_layout` checks them against the machine and makes the `RunPlan` (the layout and the strategy
object) that the rest of its process is handed. A rank started as a process of its own plans once there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Annotated

import torch
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError
from src.config.layout import Layout, resolve_device_type
from src.config.schema import Range, check_section, check_value, declared, refuse_lookalikes, target_of
from src.data.datasets import check_data_config
from src.distributed import RankEnv
from src.models import ModelStart, refuse_fit_from_disk
from src.run.cluster import check_keys
from src.run.optim import Optim
from src.run.trainer_options import TrainerOptions
from src.state.run_state import Objective
from src.strategies import Strategy, build_strategy

__all__ = ["RunPlan", "check_starting_point", "check_types", "plan_layout"]


@dataclass
class Top:
    """The top-level options of conf/train.yaml, read by the launch and the training loop."""

    seed: Annotated[int, Range(0, 2**32 - 1)]  # what every RNG takes (numpy's limit)
    train: bool
    ckpt_path: str | None
    predict: bool


GROUPS = ("paths", "data", "model", "optim", "scheduler", "strategy", "trainer", "cluster", "logger", "objective")
# the groups without a _target_ of their own, and their declarations
DECLARED = {"trainer": TrainerOptions, "objective": Objective, "optim": Optim}


@dataclass(frozen=True)
class RunPlan:
    """What a process plans once and hands down: how the work is spread, and the strategy that spreads it."""

    layout: Layout
    strategy: Strategy


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_types(cfg: DictConfig) -> None:
    """Every option on its own (each where it is declared), then the combinations that cannot work."""
    _check_each_option(cfg)
    t = cfg.trainer
    # torch's CUDA-graph trees hand out each replay's gradients in memory the next replay reuses, so gradients
    # summed over micro-batches come out wrong (pytorch/pytorch#169545, #96693)
    _expect(
        t.compile_mode != "reduce-overhead" or not t.compile or t.accumulate_grad_batches == 1,
        f"trainer.compile_mode=reduce-overhead (CUDA graphs) cannot accumulate gradients over "
        f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} micro-batches (torch sums them wrongly); "
        f"use trainer.compile_mode=default or accumulate_grad_batches=1",
    )
    e = t.ema
    shaping = [f"trainer.ema.{k}={str(e[k]).lower()}" for k in ("ramp_power", "copy_back") if e.get(k)]
    _expect(
        e.decay is not None or not shaping,
        f"{' and '.join(shaping)} need a moving average, but trainer.ema.decay=null keeps none; "
        f"set trainer.ema.decay (e.g. 0.7738 with every_n_steps=5: airbench's lookahead)",
    )


def _check_each_option(cfg: DictConfig) -> None:
    for key in cfg:
        if key not in GROUPS and key not in declared(Top) and key != "hydra":
            raise ConfigError(
                f"{key} is not an option; the top level has {', '.join(declared(Top))} and the "
                f"groups {', '.join(GROUPS)}"
            )
    for key in declared(Top):
        check_value(key, cfg.get(key), declared(Top)[key])
    if cfg.predict and cfg.train:
        raise ConfigError("predict=true writes an evaluation's predictions: add train=false ckpt_path=<checkpoint>")
    for group, options in DECLARED.items():
        check_section(cfg[group], group, options)
    metric, direction = cfg.objective.metric, cfg.objective.direction
    if (direction == "minimize") != str(metric).endswith("_loss"):
        raise ConfigError(
            f"objective.direction={direction} with objective.metric={metric} would select the worst trial; "
            f"set objective.direction={'minimize' if metric.endswith('_loss') else 'maximize'}"
        )
    if len(cfg.optim.get("betas", [0, 0])) != 2:
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    for group in ("model", "scheduler", "strategy"):  # their _target_'s signature is their schema
        skip = ("_partial_", "name", "num_classes", "in_channels", *(declared(ModelStart) if group == "model" else ()))
        check_section(cfg[group], group, target_of(cfg[group], group), skip=skip)
    start = [key for key in declared(ModelStart) if key in cfg.model]  # a model YAML of your own may lack them
    check_section(OmegaConf.masked_copy(cfg.model, start), "model", ModelStart)
    check_starting_point(cfg)
    if cfg.train and not cfg.model.get("weights") and cfg.data.get("augment") == "random_resized_crop":
        refuse_fit_from_disk(cfg.model, cfg.data.name, random_resized_crop=True)  # crops cut from the files
    for name, options in (cfg.get("logger") or {}).items():
        check_section(options, f"logger.{name}", target_of(options, f"logger.{name}"), skip=("run_dir", "cfg"))
    refuse_lookalikes(cfg.paths, "paths", ("root_dir", "data_dir", "log_dir", "output_dir"))
    check_keys(cfg.cluster)
    check_data_config(cfg.data)


def check_starting_point(cfg: DictConfig) -> None:
    """One starting point at most, and the options that need one."""
    m, t = cfg.model, cfg.trainer
    if m.get("weights") and m.get("pretrained"):
        raise ConfigError("model.weights and model.pretrained=true both name the starting weights; choose one")
    if t.get("init_from") and (m.get("weights") or m.get("pretrained")):
        raise ConfigError(
            "trainer.init_from takes every weight from its checkpoint; drop model.weights and model.pretrained"
        )
    if t.get("init_from") and cfg.train and t.resume not in (None, "none", "auto"):
        raise ConfigError(f"trainer.init_from starts a new run and trainer.resume={t.resume} continues one; choose one")
    scale = cfg.optim.get("pretrained_lr_scale", 1.0)
    if (
        isinstance(scale, (int, float))
        and 0 < scale < 1
        and not (m.get("weights") or m.get("pretrained") or t.get("init_from"))
    ):
        raise ConfigError(
            f"optim.pretrained_lr_scale={scale} scales the learning rate of pretrained weights, but the model starts "
            f"from none; set model.pretrained=true, model.weights=<file> or trainer.init_from=<checkpoint>"
        )


def _available_devices(device_type: str) -> int:
    return torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)


def plan_layout(cfg: DictConfig, env: RankEnv | None = None) -> RunPlan:
    """Validate the config against the machine (or, per `env`, the launcher that started this rank: torchrun,
    SLURM), size the run and make its strategy."""
    check_types(cfg)
    strategy = build_strategy(cfg.strategy)
    device_type = resolve_device_type(cfg)
    strategy.check(cfg, device_type)
    launched = (env.world_size, env.local_world_size) if env is not None and env.external else (None, None)
    world, per_process = strategy.processes(
        cfg.trainer.devices, _available_devices(device_type), device_type, *launched
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
    return RunPlan(Layout(strategy.name, device_type, world, per_process, accumulate, batch), strategy)
