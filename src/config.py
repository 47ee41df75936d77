"""Up-front validation of the composed config, and the sizes derived from it.

Everything here runs in the launching process before any rank starts, so a bad input costs
one line on stderr and no partial outputs.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

STRATEGIES = ("single", "dp", "ddp", "fsdp")
DISTRIBUTED = ("ddp", "fsdp")


class ConfigError(ValueError):
    """A bad input. The message is one line that says what to change."""


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _int_or_none(cfg: DictConfig, key: str, minimum: int) -> None:
    value = cfg.get(key)
    if value is None:
        return
    _expect(isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
            f"trainer.{key} must be an integer >= {minimum} or null, got {value!r}")


def check_types(cfg: DictConfig) -> None:
    """Type checks for the settings users type on the command line most."""
    t = cfg.trainer
    _expect(isinstance(t.max_epochs, int) and t.max_epochs >= 1,
            f"trainer.max_epochs must be a positive integer, got {t.max_epochs!r}")
    for key in ("amp", "channels_last", "compile", "deterministic", "progress_bar", "test_every_epoch",
                "flip_tta"):
        _expect(isinstance(t[key], bool), f"trainer.{key} must be true or false, got {t[key]!r}")
    _expect(isinstance(cfg.train, bool), f"train must be true or false, got {cfg.train!r}")
    _expect(t.amp_dtype in ("bf16", "fp16"), f"trainer.amp_dtype must be bf16 or fp16, got {t.amp_dtype!r}")
    _expect(t.device in ("auto", "cpu", "cuda"), f"trainer.device must be auto, cpu or cuda, got {t.device!r}")
    _expect(t.devices == "auto" or (isinstance(t.devices, int) and t.devices >= 1),
            f"trainer.devices must be 'auto' or a positive integer, got {t.devices!r}")
    _int_or_none(t, "accumulate_grad_batches", 1)
    _int_or_none(t, "limit_train_batches", 1)
    _int_or_none(t, "limit_eval_batches", 1)
    _int_or_none(t, "max_restarts", 0)
    _expect(t.accumulate_grad_batches is not None, "trainer.accumulate_grad_batches must be >= 1")
    for key in ("batch_size", "eval_batch_size"):
        v = cfg.data[key]
        _expect(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                f"data.{key} must be a positive integer, got {v!r}")
    cut = cfg.data.get("cutout", 0)
    _expect(isinstance(cut, int) and not isinstance(cut, bool) and cut >= 0,
            f"data.cutout must be a side length in pixels (0 = off), got {cut!r}")
    augment = cfg.data.get("augment", "none")  # "auto" is resolved when the images are read (loaders.py checks)
    _expect(not cut or augment in ("crop_flip", "auto"),
            f"data.cutout={cut} needs data.augment=crop_flip, got {augment!r}; set data.cutout=0")
    pad_mode = cfg.data.get("pad_mode", "zeros")
    _expect(pad_mode in ("zeros", "reflect"), f"data.pad_mode must be zeros or reflect, got {pad_mode!r}")
    shift = t.get("tta_shift", 0)
    _expect(isinstance(shift, int) and not isinstance(shift, bool) and shift >= 0,
            f"trainer.tta_shift must be a number of pixels >= 0 (0 = off), got {shift!r}")
    vf = cfg.data.get("val_fraction", 0.0)
    _expect(isinstance(vf, (int, float)) and 0 <= vf < 1, f"data.val_fraction must be in [0, 1), got {vf!r}")
    _expect(isinstance(cfg.seed, int), f"seed must be an integer, got {cfg.seed!r}")
    _expect(cfg.strategy.name in STRATEGIES, f"strategy.name must be one of {STRATEGIES}, got {cfg.strategy.name!r}")
    hook = cfg.strategy.get("comm_hook")
    _expect(hook in (None, "none", "fp16", "bf16"), f"strategy.comm_hook must be none, fp16 or bf16, got {hook!r}")
    modes, mode = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"), t.compile_mode
    _expect(mode in modes, f"trainer.compile_mode must be one of {', '.join(modes)}, got {mode!r}")
    _expect(mode != "reduce-overhead" or cfg.strategy.name in ("single", "ddp"),
            f"trainer.compile_mode=reduce-overhead (CUDA graphs) works with strategy=single or ddp, not "
            f"{cfg.strategy.name}; use trainer.compile_mode=default")
    # torch's CUDA-graph trees hand out each replay's gradients in memory the next replay reuses, so gradients
    # summed over micro-batches come out wrong (pytorch/pytorch#169545, #96693)
    _expect(mode != "reduce-overhead" or not t.compile or t.accumulate_grad_batches == 1,
            f"trainer.compile_mode=reduce-overhead (CUDA graphs) cannot accumulate gradients over "
            f"trainer.accumulate_grad_batches={t.accumulate_grad_batches} micro-batches (torch sums them wrongly); "
            f"use trainer.compile_mode=default or accumulate_grad_batches=1")
    sync = cfg.strategy.get("gradient_sync", "reducer")
    _expect(sync in ("reducer", "after_backward", "auto"),
            f"strategy.gradient_sync must be reducer, after_backward or auto, got {sync!r}")
    scope = cfg.strategy.get("compile_scope", "module")
    _expect(scope in ("module", "wrapper"), f"strategy.compile_scope must be module or wrapper, got {scope!r}")
    _expect(cfg.data.get("loader", "auto") in ("auto", "classic", "gpu"),
            f"data.loader must be auto, classic or gpu, got {cfg.data.loader!r}")


def resolve_device_type(cfg: DictConfig) -> str:
    wanted = cfg.trainer.device
    if wanted == "cuda":
        _expect(torch.cuda.is_available(),
                "trainer.device=cuda but no CUDA GPU is visible; use trainer.device=cpu (or auto)")
        return "cuda"
    if wanted == "cpu":
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Layout:
    """How the work is spread: processes, devices, and the batch each one sees."""

    strategy: str
    device_type: str
    world_size: int          # processes
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


def _available_devices(device_type: str) -> int:
    return torch.cuda.device_count() if device_type == "cuda" else (os.cpu_count() or 1)


def plan_layout(cfg: DictConfig, launched_world_size: int | None = None,
                launched_local_size: int | None = None) -> Layout:
    """Validate the config against the machine (or the launcher that started us) and size the run.

    launched_world_size: the world size of an external launcher (torchrun, SLURM), if any.
    """
    check_types(cfg)
    strategy = cfg.strategy.name
    device_type = resolve_device_type(cfg)
    requested = cfg.trainer.devices
    available = _available_devices(device_type)
    if cfg.strategy.sync_bn:
        _expect(strategy == "ddp", f"strategy.sync_bn=true works only with strategy=ddp (SyncBatchNorm needs "
                                   f"DistributedDataParallel), got strategy={strategy}; drop strategy.sync_bn")
        _expect(device_type == "cuda", "strategy.sync_bn=true needs CUDA GPUs (torch's SyncBatchNorm has no CPU "
                                       "kernel); drop it on CPU, or use model.batch_norm=false")
    if strategy == "dp":
        _expect(device_type == "cuda", "strategy=dp (nn.DataParallel) needs CUDA GPUs and none is in use; "
                                       "HINT: use strategy=ddp trainer.devices=2 for multi-process training on CPU")
        _expect(launched_world_size in (None, 1), f"strategy=dp runs one process but the launcher started "
                                                  f"{launched_world_size}; HINT: use strategy=ddp, or launch 1 task")
        n = available if requested == "auto" else requested
        _expect(n <= available, f"trainer.devices={n} but only {available} GPU(s) are visible; lower trainer.devices")
        world, per_process = 1, n
    elif strategy == "single":
        _expect(launched_world_size in (None, 1), f"strategy=single runs one process but the launcher started "
                                                  f"{launched_world_size}; HINT: use strategy=ddp")
        _expect(requested in ("auto", 1), f"strategy=single uses one device, got trainer.devices={requested}; "
                                          f"HINT: use strategy=ddp or dp for several")
        world, per_process = 1, 1
    else:
        if launched_world_size is not None:
            if requested != "auto" and launched_local_size is not None:
                _expect(requested == launched_local_size,
                        f"trainer.devices={requested} disagrees with the launcher's {launched_local_size} processes "
                        f"on this node; set trainer.devices={launched_local_size} or trainer.devices=auto")
            world = launched_world_size
        else:
            if requested == "auto":  # every GPU; on a CPU-only machine, two gloo processes
                requested = available if device_type == "cuda" else min(2, available)
            _expect(requested <= available, f"trainer.devices={requested} but only {available} "
                                            f"{'GPU' if device_type == 'cuda' else 'CPU core'}(s) are available; "
                                            f"lower trainer.devices")
            world = requested
        _expect(world >= 2, f"strategy={strategy} with a single process; HINT: set trainer.devices=2 "
                            f"(or more), or use strategy=single")
        per_process = 1
    accumulate = cfg.trainer.accumulate_grad_batches
    batch = cfg.data.batch_size
    _expect(batch % (world * accumulate * per_process) == 0,
            f"data.batch_size={batch} (global) is not divisible by world_size*accumulate_grad_batches*"
            f"devices_per_process={world}*{accumulate}*{per_process}; pick a multiple of "
            f"{world * accumulate * per_process}")
    if cfg.trainer.amp and cfg.trainer.amp_dtype == "fp16":
        _expect(device_type == "cuda", "trainer.amp_dtype=fp16 needs a CUDA GPU; use trainer.amp_dtype=bf16 on CPU")
    return Layout(strategy, device_type, world, per_process, accumulate, batch)
