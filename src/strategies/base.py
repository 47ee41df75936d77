"""The base `Strategy` (one process, one device), its `Context`, the process-group base of ddp and fsdp,
and `build_strategy`.

`core` is the model without the `module.` prefix of DDP/DataParallel, and checkpoints are written through
torch's state-dict helpers, which also drop the prefixes of compiled blocks (`_orig_mod.`) and of activation
checkpointing: a checkpoint from any strategy, in either format (src/state/checkpoint.py), loads in any other.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from src.config.errors import ConfigError
from src.state import checkpoint as ckpt
from src.strategies.blocks import shard_targets
from src.strategies.ema import EMA


def _dcp():
    """torch's state-dict helpers, imported on first use: they pull in DTensor (~0.7 s of imports) that a
    launcher or a refused run never needs."""
    from torch.distributed.checkpoint import state_dict

    return state_dict


@dataclass
class Context:
    """What a strategy needs to know about the run when it wraps the model."""

    device: torch.device
    amp: bool
    amp_dtype: torch.dtype
    devices_per_process: int = 1
    compile: bool = False
    compile_mode: str = "default"

    @property
    def cuda_graphs(self) -> bool:
        return self.compile and self.compile_mode == "reduce-overhead"

    def compiled(self, module: nn.Module, **inductor) -> nn.Module:
        """torch.compile in trainer.compile_mode; `inductor`: config on top of the mode's (compile takes one or
        the other, so the mode's own options are spelled out)."""
        if not self.compile:
            return module
        if not inductor:
            return torch.compile(module, mode=self.compile_mode)
        from torch._inductor import list_mode_options

        return torch.compile(module, options={**list_mode_options(self.compile_mode), **inductor})


@dataclass
class Strategy:
    """The base: one process on one device, nothing to sync. Subclasses override what differs."""

    sync_bn: bool = False

    name: ClassVar[str] = "single"
    gathers_to_host: ClassVar[bool] = False  # a full checkpoint is gathered into host memory (fsdp's shards)
    multiprocess: ClassVar[bool] = False  # one process per device (started by train.py or a launcher)
    cuda_graphs: ClassVar[bool] = True  # trainer.compile_mode=reduce-overhead works
    fused_optimizer: ClassVar[bool] = True  # the optimizer's fused CUDA kernels work on its parameters
    channels_last_weights: ClassVar[bool] = True  # weights may be converted to channels_last
    cudnn_benchmark: ClassVar[bool] = True
    batchnorm_sync: ClassVar[bool] = False  # strategy.sync_bn=true works (BatchNorm over every rank's batch)
    averages_gradients: ClassVar[bool] = False  # the sync divides by the world size (DDP's reducer, FSDP)
    ema: ClassVar[EMA | None] = None  # trainer.ema: set by the trainer after wrap; saved and resumed with the model

    # --- before any process starts -------------------------------------------------------------
    def check(self, cfg, device_type: str) -> None:
        """Options that do not fit this strategy, the trainer settings or the device type."""
        if self.sync_bn and not self.batchnorm_sync:
            raise ConfigError(
                f"strategy.sync_bn=true works only with strategy=ddp (BatchNorm over every rank's batch), "
                f"got strategy={self.name}; drop strategy.sync_bn"
            )
        t = cfg.trainer
        if t.compile_mode == "reduce-overhead" and not self.cuda_graphs:
            raise ConfigError(
                f"trainer.compile_mode=reduce-overhead (CUDA graphs) works with strategy=single, ddp or "
                f"fsdp, not {self.name}; use trainer.compile_mode=default"
            )

    def processes(
        self, requested, available: int, device_type: str, launched: int | None, launched_local: int | None
    ) -> tuple[int, int]:
        """(processes, devices per process) for trainer.devices=`requested` on this machine, or a ConfigError.
        `launched`: the world size an external launcher (torchrun, SLURM) started, if any."""
        if launched not in (None, 1):
            raise ConfigError(
                f"strategy={self.name} runs one process but the launcher started {launched}; HINT: use strategy=ddp"
            )
        if requested not in ("auto", 1):
            raise ConfigError(
                f"strategy={self.name} uses one device, got trainer.devices={requested}; "
                f"HINT: use strategy=ddp or dp for several"
            )
        return 1, 1

    def preflight(self, cfg) -> None:
        """Checks that need the model (built on the meta device: no memory, no time)."""

    def memory_fixes(self, devices: int) -> list[str]:
        """What this strategy can change when a step runs out of memory (`devices`: the GPUs there are)."""
        return [f"shard the model with strategy=fsdp trainer.devices={devices if devices > 1 else 'N'}"]

    def hparams(self, cfg) -> dict:
        """The strategy's settings a comparison is about (HParams, metrics.json, the report)."""
        return {"strategy": self.name, "sync_bn": self.sync_bn, "gradient_sync": "none"}

    # --- in each rank ---------------------------------------------------------------------------
    def release(self) -> None:
        """Forget what the run attached (the model, its wrapper, the EMA): the plan that holds this strategy may
        outlive the run, its model and process group must not."""
        settings = {f.name for f in fields(self)}
        for name in [name for name in vars(self) if name not in settings]:
            delattr(self, name)

    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        """Wrap (and compile) `model`; return the module the loop calls."""
        self.core = model
        self.model = ctx.compiled(model)
        return self.model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, fused: bool) -> torch.optim.Optimizer:
        """The optimizer built over `core`'s parameters, made ready for the loop to step; `fused`: the loop's
        device has torch's fused optimizer kernels."""
        return optimizer

    def sync_context(self, boundary: bool):
        """Around a micro-step's forward and backward: skip the gradient sync unless it ends the step."""
        return contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """After an optimizer step's last backward: the all-reduce, where the strategy defers it."""

    def sync_buffers(self) -> None:
        """Make every rank's buffers (BatchNorm running stats) rank 0's, where the strategy keeps them so."""

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a global norm of at most `max_norm`; return the norm they had."""
        total = torch.nn.utils.clip_grad_norm_(self.core.parameters(), max_norm)
        return total.full_tensor() if hasattr(total, "full_tensor") else total  # fsdp: a DTensor

    def eval_module(self) -> nn.Module:
        """The uncompiled module to evaluate with (no-grad mode and an odd last batch would each recompile)."""
        self.sync_buffers()
        return self.core

    def state_dict(self, optimizer, offload: bool = True) -> tuple[dict, dict]:
        """Unsharded model and optimizer state keyed by parameter name (collective under fsdp); `offload`: in host
        memory, else where the model is (its own tensors, not copies)."""
        return _dcp().get_state_dict(
            self.core, optimizer, options=_dcp().StateDictOptions(full_state_dict=True, cpu_offload=offload)
        )

    def load_state_dict(self, model_state: dict, optimizer=None, optim_state: dict | None = None, strict=True) -> None:
        options = _dcp().StateDictOptions(full_state_dict=True, strict=strict)
        if optimizer is None:
            _dcp().set_model_state_dict(self.core, model_state, options=options)
        else:
            _dcp().set_state_dict(
                self.core, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options
            )

    def save_checkpoint(
        self,
        directory: Path,
        names: list[str],
        optimizer,
        state: dict,
        primary: bool,
        background: ckpt.BackgroundWrites | None = None,
    ) -> None:
        """Collective: checkpoints `names` ("last", "best") of the model, the optimizer and `state` (the rest).
        Here the full state is gathered and rank 0 writes `<name>.pt`, or has `background` write it while training
        goes on. That copies the GPU's tensors to the host itself, in the GPU's stream order: the state is taken
        where it is, unless gathering it there would hold a second full model (`gathers_to_host`)."""
        offload = background is None or self.gathers_to_host
        average = {"ema": self.ema_state(full=True, offload=offload)} if self.ema else {}
        model_state, optim_state = self.state_dict(optimizer, offload)
        if primary:
            full = {"model": model_state, "optimizer": optim_state, **average, **state}
            background.start(full, directory, names) if background else ckpt.save_full(full, directory, names)

    def ema_state(self, full: bool, offload: bool = True) -> dict:
        """The EMA as a state dict keyed as the model's (`full`: gathered to rank 0, in host memory with `offload`,
        else this rank's shards); collective under fsdp. The model holds the average while torch's helper reads it."""
        options = _dcp().StateDictOptions(full_state_dict=True, cpu_offload=offload) if full else None
        with self.ema.swapped():  # copies: the helper may return the model's own tensors
            return {k: v.clone() for k, v in _dcp().get_model_state_dict(self.core, options=options).items()}

    def load_checkpoint(self, path, optimizer=None, head: set[str] = frozenset()) -> dict:
        """Load a checkpoint of either format into the model (and `optimizer`); return the rest of its state.
        From a sharded one each rank reads what its own layout holds, whatever number of ranks wrote it.
        `head` (trainer.init_from): entries left as initialized where their shape differs (another class
        count); the returned state lists them as `new_head`."""
        path = Path(path)
        state = ckpt.load(path)
        shapes = {k: tuple(v.shape) for k, v in _dcp().get_model_state_dict(self.core).items()}  # no gather
        saved = ckpt.saved_shapes(path, state)
        new = sorted(k for k in head if k in saved and k in shapes and saved[k] != shapes[k])
        advice = "use the model= it was trained with" if head else ckpt.RESUME_ADVICE
        ckpt.check_compatible(
            {k: v for k, v in saved.items() if k not in new},
            {k: v for k, v in shapes.items() if k not in new},
            f"checkpoint {path}",
            advice,
        )
        state["new_head"] = new
        # a checkpoint's weights to evaluate, export or start from are its average (`ema`) when it has one; a
        # resumed run takes its raw weights (`model`) and, if it keeps an average too, the saved one
        averaged = state.get("ema_decay") is not None
        weights = "ema" if averaged and optimizer is None else "model"
        resumed_average = averaged and optimizer is not None and self.ema is not None
        if not path.is_dir():
            model_state = {k: v for k, v in state[weights].items() if k not in new}
            self.load_state_dict(model_state, optimizer, state["optimizer"] if optimizer is not None else None, not new)
            if resumed_average:
                with self.ema.swapped():  # loaded into the model's place, then swapped out into the average
                    self.load_state_dict(state["ema"])
        else:
            self._load_sharded(path, optimizer, new, weights, resumed_average)
        if self.ema is not None and not resumed_average:  # the average starts from the weights loaded
            self.ema.capture()
        return state

    def _load_sharded(self, path: Path, optimizer, new: list[str], weights: str, resumed_average: bool) -> None:
        if optimizer is None:
            tensors = {weights: _dcp().get_model_state_dict(self.core)}
        else:  # torch fills a fresh optimizer's state with placeholders for DCP to load into
            tensors = dict(zip(("model", "optimizer"), _dcp().get_state_dict(self.core, optimizer)))
        if resumed_average:  # copies to load into: the model's own tensors are the raw weights' destination
            tensors["ema"] = {k: v.clone() for k, v in _dcp().get_model_state_dict(self.core).items()}
        tensors[weights] = {k: v for k, v in tensors[weights].items() if k not in new}  # DCP reads only these
        with warnings.catch_warnings():  # one process (no process group) reading it is intended
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            ckpt.dcp_load(tensors, path)
        options = _dcp().StateDictOptions(strict=not new)
        if optimizer is None:
            _dcp().set_model_state_dict(self.core, tensors[weights], options=options)
        else:
            _dcp().set_state_dict(
                self.core,
                optimizer,
                model_state_dict=tensors["model"],
                optim_state_dict=tensors["optimizer"],
                options=options,
            )
        if resumed_average:  # after the raw weights: `tensors["model"]` are the model's own tensors
            with self.ema.swapped():
                _dcp().set_model_state_dict(self.core, tensors["ema"])

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks, each recomputed as one by activation checkpointing (FSDP: its shard units)."""
        return shard_targets(model, "auto")

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The parameters each rank holds whole (FSDP's DTensors are sharded)."""
        from torch.distributed.tensor import DTensor

        return [p for p in self.core.parameters() if not isinstance(p, DTensor)]

    def replicas_agree(self, device: torch.device) -> dict[str, bool]:
        """Are the parameters / BatchNorm running stats identical on every rank? Sharded (FSDP) parameters
        exist once and agree by construction; replicated ones are compared through an all-reduce of max and min."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return {"params_in_sync": True, "bn_buffers_in_sync": True}
        groups = {
            "params_in_sync": self.replicated_parameters(),
            "bn_buffers_in_sync": [b for n, b in self.core.named_buffers() if "running_" in n],
        }
        result = {}
        for key, tensors in groups.items():
            if not tensors:
                result[key] = True
                continue
            flat = torch.cat([t.detach().double().flatten() for t in tensors]).to(device)
            hi, lo = flat.clone(), flat.clone()
            dist.all_reduce(hi, op=dist.ReduceOp.MAX)
            dist.all_reduce(lo, op=dist.ReduceOp.MIN)
            result[key] = bool(torch.equal(hi, lo))
        return result


@dataclass
class _Distributed(Strategy):
    """One process per device, in a process group."""

    multiprocess: ClassVar[bool] = True

    def processes(self, requested, available, device_type, launched, launched_local):
        if launched is not None:
            if requested != "auto" and launched_local is not None and requested != launched_local:
                raise ConfigError(
                    f"trainer.devices={requested} disagrees with the launcher's {launched_local} "
                    f"processes on this node; set trainer.devices={launched_local} or trainer.devices=auto"
                )
            world = launched
        else:
            if requested == "auto":  # every GPU; on a CPU-only machine, two gloo processes
                requested = available if device_type == "cuda" else min(2, available)
            if requested > available:
                raise ConfigError(
                    f"trainer.devices={requested} but only {available} "
                    f"{'GPU' if device_type == 'cuda' else 'CPU core'}(s) are available; "
                    f"lower trainer.devices"
                )
            world = requested
        if world < 2:
            raise ConfigError(
                f"strategy={self.name} with a single process; HINT: set trainer.devices=2 "
                f"(or more), or use strategy=single"
            )
        return world, 1


def _broadcast_from_rank0(module: nn.Module, parameters: bool = True) -> None:
    """What DDP does when it wraps a model: every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*(module.parameters() if parameters else ()), *module.buffers()]:
            dist.broadcast(tensor, src=0)


def build_strategy(cfg) -> Strategy:
    """The strategy object of `cfg.strategy` (its options were checked against its signature by src/run/plan.py)."""
    from hydra.utils import instantiate

    return instantiate(cfg, _convert_="all")
