"""The `strategy/` group: one class per strategy, chosen by `_target_` in conf/strategy/<name>.yaml.

A strategy owns everything that differs between them: how many processes and devices it needs
(checked against the machine or the launcher before anything starts), how it wraps and compiles the
model, skipping gradient sync on accumulation micro-steps, gradient and buffer sync, the module to
evaluate, checkpoint state in and out, and what it supports. Nothing else compares strategy names.
Adding one: a subclass here (or in any importable module) and a YAML naming it (docs/extending.md).

`core` keeps the parameter names without `module.` prefixes, so a checkpoint from any strategy loads
in any other.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from src.schema import ConfigError, PositiveReal


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

    def compiled(self, module: nn.Module) -> nn.Module:
        return torch.compile(module, mode=self.compile_mode) if self.compile else module


@dataclass
class Strategy:
    """The base: one process on one device, nothing to sync. Subclasses override what differs."""

    sync_bn: bool = False

    name: ClassVar[str] = "single"
    multiprocess: ClassVar[bool] = False       # one process per device (started by train.py or a launcher)
    cuda_graphs: ClassVar[bool] = True          # trainer.compile_mode=reduce-overhead works
    fused_optimizer: ClassVar[bool] = True      # the optimizer's fused CUDA kernels work on its parameters
    channels_last_weights: ClassVar[bool] = True  # weights may be converted to channels_last
    cudnn_benchmark: ClassVar[bool] = True
    averages_gradients: ClassVar[bool] = False  # the sync divides by the world size (DDP's reducer, FSDP)

    # --- before any process starts -------------------------------------------------------------
    def check(self, cfg, device_type: str) -> None:
        """Options that do not fit this strategy, the trainer settings or the device type."""
        if self.sync_bn:
            raise ConfigError(f"strategy.sync_bn=true works only with strategy=ddp (SyncBatchNorm needs "
                              f"DistributedDataParallel), got strategy={self.name}; drop strategy.sync_bn")
        t = cfg.trainer
        if t.compile_mode == "reduce-overhead" and not self.cuda_graphs:
            raise ConfigError(f"trainer.compile_mode=reduce-overhead (CUDA graphs) works with strategy=single or "
                              f"ddp, not {self.name}; use trainer.compile_mode=default")

    def processes(self, requested, available: int, device_type: str, launched: int | None,
                  launched_local: int | None) -> tuple[int, int]:
        """(processes, devices per process) for trainer.devices=`requested` on this machine, or a ConfigError.
        `launched`: the world size an external launcher (torchrun, SLURM) started, if any."""
        if launched not in (None, 1):
            raise ConfigError(f"strategy={self.name} runs one process but the launcher started {launched}; "
                              f"HINT: use strategy=ddp")
        if requested not in ("auto", 1):
            raise ConfigError(f"strategy={self.name} uses one device, got trainer.devices={requested}; "
                              f"HINT: use strategy=ddp or dp for several")
        return 1, 1

    def preflight(self, cfg) -> None:
        """Checks that need the model (built on the meta device: no memory, no time)."""

    def hparams(self, cfg) -> dict:
        """The strategy's settings a comparison is about (HParams, metrics.json, the report)."""
        return {"strategy": self.name, "sync_bn": self.sync_bn, "gradient_sync": "none"}

    # --- in each rank ---------------------------------------------------------------------------
    def wrap(self, model: nn.Module, ctx: Context) -> nn.Module:
        """Wrap (and compile) `model`; return the module the loop calls."""
        self.core = model
        self.model = ctx.compiled(model)
        return self.model

    def sync_context(self, boundary: bool):
        """Around a micro-step's forward and backward: skip the gradient sync unless it ends the step."""
        return contextlib.nullcontext()

    def sync_gradients(self) -> None:
        """After an optimizer step's last backward: the all-reduce, where the strategy defers it."""

    def sync_buffers(self) -> None:
        """Make every rank's buffers (BatchNorm running stats) rank 0's, where the strategy keeps them so."""

    def eval_module(self) -> nn.Module:
        """The uncompiled module to evaluate with (no-grad mode and an odd last batch would each recompile)."""
        self.sync_buffers()
        return self.core

    def state_dict(self, optimizer) -> tuple[dict, dict]:
        """Unsharded model and optimizer state keyed by parameter name (collective under fsdp)."""
        return get_state_dict(self.core, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, model_state: dict, optimizer=None, optim_state: dict | None = None) -> None:
        options = StateDictOptions(full_state_dict=True, strict=True)
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict
            set_model_state_dict(self.core, model_state, options=options)
        else:
            set_state_dict(self.core, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                           options=options)

    def replicas_agree(self, device: torch.device) -> dict[str, bool]:
        """Are the parameters / BatchNorm running stats identical on every rank? Sharded (FSDP) parameters
        exist once and agree by construction; replicated ones are compared through an all-reduce of max and min."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return {"params_in_sync": True, "bn_buffers_in_sync": True}
        from torch.distributed.tensor import DTensor

        groups = {"params_in_sync": [p for p in self.core.parameters() if not isinstance(p, DTensor)],
                  "bn_buffers_in_sync": [b for n, b in self.core.named_buffers() if "running_" in n]}
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
            raise ConfigError("strategy=dp (nn.DataParallel) needs CUDA GPUs and none is in use; "
                              "HINT: use strategy=ddp trainer.devices=2 for multi-process training on CPU")
        if launched not in (None, 1):
            raise ConfigError(f"strategy=dp runs one process but the launcher started {launched}; "
                              f"HINT: use strategy=ddp, or launch 1 task")
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


@dataclass
class _Distributed(Strategy):
    """One process per device, in a process group."""

    multiprocess: ClassVar[bool] = True

    def processes(self, requested, available, device_type, launched, launched_local):
        if launched is not None:
            if requested != "auto" and launched_local is not None and requested != launched_local:
                raise ConfigError(f"trainer.devices={requested} disagrees with the launcher's {launched_local} "
                                  f"processes on this node; set trainer.devices={launched_local} or trainer.devices=auto")
            world = launched
        else:
            if requested == "auto":  # every GPU; on a CPU-only machine, two gloo processes
                requested = available if device_type == "cuda" else min(2, available)
            if requested > available:
                raise ConfigError(f"trainer.devices={requested} but only {available} "
                                  f"{'GPU' if device_type == 'cuda' else 'CPU core'}(s) are available; "
                                  f"lower trainer.devices")
            world = requested
        if world < 2:
            raise ConfigError(f"strategy={self.name} with a single process; HINT: set trainer.devices=2 "
                              f"(or more), or use strategy=single")
        return world, 1


COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # strategy.comm_hook -> all-reduce dtype


@dataclass
class DDP(_Distributed):
    """DistributedDataParallel, or (gradient_sync=after_backward) one flat all-reduce after the backward."""

    bucket_cap_mb: Annotated[float, PositiveReal] = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True   # false: each rank keeps its own BatchNorm running stats (they drift apart)
    comm_hook: Literal["none", "fp16", "bf16"] | None = "none"
    compile_scope: Literal["module", "wrapper"] = "module"
    gradient_sync: Literal["reducer", "after_backward", "auto"] = "auto"

    name: ClassVar[str] = "ddp"

    def check(self, cfg, device_type):
        if self.sync_bn and device_type != "cuda":
            raise ConfigError("strategy.sync_bn=true needs CUDA GPUs (torch's SyncBatchNorm has no CPU "
                              "kernel); drop it on CPU, or use model.batch_norm=false")
        sync_bn, self.sync_bn = self.sync_bn, False  # allowed here, unlike the base class
        try:
            super().check(cfg, device_type)
        finally:
            self.sync_bn = sync_bn

    def resolved_gradient_sync(self, compile: bool, compile_mode: str) -> str:
        """auto: after_backward exactly when the backward is one CUDA graph (nothing left to overlap)."""
        if self.gradient_sync == "auto":
            return "after_backward" if compile and compile_mode == "reduce-overhead" else "reducer"
        return self.gradient_sync

    def hparams(self, cfg):
        t = cfg.trainer
        return {**super().hparams(cfg), "gradient_sync": self.resolved_gradient_sync(t.compile, t.compile_mode)}

    @property
    def averages_gradients(self) -> bool:  # the flat all-reduce sums; DDP's reducer averages
        return self.after_backward is None

    def wrap(self, model, ctx):
        if self.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.core, self.after_backward = model, None
        if self.resolved_gradient_sync(ctx.compile, ctx.compile_mode) == "after_backward":
            _broadcast_from_rank0(model)
            self.after_backward = FlatGradientSync(model.parameters(), COMM_DTYPES.get(self.comm_hook))
            self.wrapper = self.model = ctx.compiled(model)
            return self.model
        # compile_scope=module: DDP wraps the compiled model (one graph; DDP's hooks stay outside it);
        # wrapper: compile the DDP wrapper (DDPOptimizer cuts the graph at gradient-bucket boundaries)
        inner = ctx.compiled(model) if self.compile_scope == "module" else model
        with warnings.catch_warnings():  # newer torch renames broadcast_buffers; keep the name 2.11 knows
            warnings.simplefilter("ignore", FutureWarning)
            self.wrapper = nn.parallel.DistributedDataParallel(
                inner, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                bucket_cap_mb=self.bucket_cap_mb, gradient_as_bucket_view=self.gradient_as_bucket_view,
                static_graph=self.static_graph, find_unused_parameters=self.find_unused_parameters,
                broadcast_buffers=self.broadcast_buffers)
        if self.comm_hook in COMM_DTYPES:  # halve the bytes of the gradient all-reduce
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            self.wrapper.register_comm_hook(None, getattr(default_hooks, f"{self.comm_hook}_compress_hook"))
        self.model = ctx.compiled(self.wrapper) if self.compile_scope == "wrapper" else self.wrapper
        return self.model

    def sync_context(self, boundary):
        if boundary or self.after_backward is not None:  # after_backward: nothing syncs before it is called
            return contextlib.nullcontext()
        return self.wrapper.no_sync()

    def sync_gradients(self):
        if self.after_backward is not None:
            self.after_backward()

    def sync_buffers(self):
        """What DDP does before each forward (with broadcast_buffers): every rank takes rank 0's buffers."""
        if self.broadcast_buffers and dist.is_initialized():
            with torch.no_grad():
                for buffer in self.core.buffers():
                    dist.broadcast(buffer, src=0)


class FlatGradientSync:
    """Every gradient summed over ranks by one all-reduce of one flat buffer, after the whole backward.

    DDP's reducer all-reduces buckets from per-parameter autograd hooks so that communication overlaps
    the backward. When the backward is one CUDA graph (compile_mode=reduce-overhead) every hook fires at
    its end: nothing is left to overlap, and one packed all-reduce after it measured faster in the loop
    than DDP's reducer (and than cutting the graph at buckets to overlap; bench/README.md lists the reports).
    The gradients are copied into a flat buffer kept from step to step (one foreach copy; a fresh
    torch.cat every step cost ~0.12 ms more on the device), and the reduced buffer becomes the gradients:
    views with each parameter's own strides, so there is no unpacking copy.
    """

    def __init__(self, params, dtype: torch.dtype | None = None):
        self.params = [p for p in params if p.requires_grad]
        self.dtype = dtype  # fp16/bf16: fewer bytes on the wire, less exact
        self._layout = None  # the gradients' strides, and a flat buffer with a view laid out like each

    def __call__(self) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        strides = [g.stride() for g in grads]
        if self._layout is None or self._layout[0] != strides:
            self._layout = (strides, *self._buffer(grads))
        _, flat, views = self._layout
        torch._foreach_copy_(views, grads)  # same strides: plain copies, in as few kernels as torch can
        if self.dtype is None:
            dist.all_reduce(flat)
        else:
            wire = flat.to(self.dtype)
            dist.all_reduce(wire)
            flat.copy_(wire)
        for p, view in zip(self.params, views):
            p.grad = view

    @staticmethod
    def _buffer(grads):
        flat = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype, device=grads[0].device)
        views, offset = [], 0
        for g in grads:
            views.append(flat.as_strided(g.shape, _flat_layout_strides(g), offset))
            offset += g.numel()
        return flat, views


def _flat_layout_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides for a view of a flat buffer that holds `t`: its own when `t` is dense in any dimension order
    (channels_last included), so the buffer keeps its memory order and copies in and out are plain;
    contiguous ones for any other tensor."""
    order = sorted(range(t.dim()), key=t.stride, reverse=True)
    if t.permute(order).is_contiguous():
        return t.stride()
    return torch.empty(t.shape, device="meta").stride()


@dataclass
class FSDP(_Distributed):
    """FSDP2 (torch.distributed.fsdp.fully_shard); bf16 params and compute, fp32 gradient reduction with amp."""

    shard_modules: Literal["auto"] | list[str] | None = "auto"  # auto: the children (resnet layers: their blocks)
    reshard_after_forward: bool = True

    name: ClassVar[str] = "fsdp"
    cuda_graphs: ClassVar[bool] = False
    fused_optimizer: ClassVar[bool] = False      # the fused kernels do not take DTensor parameters
    channels_last_weights: ClassVar[bool] = False  # FSDP2 cannot shard non-contiguous weights
    averages_gradients: ClassVar[bool] = True

    def preflight(self, cfg):
        from src.models import build_model

        with torch.device("meta"):
            shard_targets(build_model(cfg.model, num_classes=10, in_channels=3), self.shard_modules)

    def wrap(self, model, ctx):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=ctx.amp_dtype, reduce_dtype=torch.float32) if ctx.amp else \
            MixedPrecisionPolicy()
        for sub in shard_targets(model, self.shard_modules):
            fully_shard(sub, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=self.reshard_after_forward)
        self.core = model
        self.model = ctx.compiled(model)
        return self.model

    def sync_context(self, boundary):
        return contextlib.nullcontext() if boundary else _fsdp_no_sync(self.core)

    def sync_buffers(self):
        """FSDP2 leaves buffers (BatchNorm running stats) replicated and unsynchronized: take rank 0's, as
        DDP's broadcast_buffers does, so every rank evaluates with the same weights and stats."""
        if dist.is_initialized():
            _broadcast_from_rank0(self.core, parameters=False)


@contextlib.contextmanager
def _fsdp_no_sync(core: nn.Module):
    core.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        core.set_requires_gradient_sync(True)


def shard_targets(model: nn.Module, spec) -> list[nn.Module]:
    """The sub-modules FSDP wraps one by one (each becomes one all-gather unit)."""
    if spec in (None, "auto"):
        targets = [m for m in model.children() if any(True for _ in m.parameters())]
        # a Sequential of blocks (resnet layers) shards block by block
        expanded = []
        for m in targets:
            expanded.extend(m.children() if isinstance(m, nn.Sequential) and len(m) > 1 else [m])
        targets = [m for m in expanded if any(True for _ in m.parameters())]
    else:
        names = set(spec)
        targets = [m for m in model.modules() if type(m).__name__ in names]
        if not targets:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(f"strategy.shard_modules={sorted(names)} matches no module of the model; "
                              f"choose among {found[:15]} or use auto")
    if not targets:
        raise ConfigError(f"fsdp cannot shard {type(model).__name__}: it has no sub-module with parameters; "
                          f"use strategy=ddp")
    return targets


def _broadcast_from_rank0(module: nn.Module, parameters: bool = True) -> None:
    """What DDP does when it wraps a model: every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*(module.parameters() if parameters else ()), *module.buffers()]:
            dist.broadcast(tensor, src=0)


def build_strategy(cfg) -> Strategy:
    """The strategy object of `cfg.strategy` (its options were checked by src.schema)."""
    from hydra.utils import instantiate

    return instantiate(cfg, _convert_="all")
