"""The `strategy/` group: one class per strategy, chosen by `_target_` in conf/strategy/<name>.yaml.

A strategy owns everything that differs between them: how many processes and devices it needs
(checked against the machine or the launcher before anything starts), how it wraps and compiles the
model, skipping gradient sync on accumulation micro-steps, gradient and buffer sync, the module to
evaluate, checkpoint state in and out, and what it supports. Nothing else compares strategy names.
Adding one: a subclass here (or in any importable module) and a YAML naming it (docs/extending.md).

`core` is the model without the `module.` prefix of DDP/DataParallel, and checkpoints are written through
torch's state-dict helpers, which also drop the prefixes of compiled blocks (`_orig_mod.`) and of activation
checkpointing: a checkpoint from any strategy, in either format (src/checkpoint.py), loads in any other.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from src import checkpoint as ckpt
from src.schema import ConfigError, Positive, PositiveReal


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
    multiprocess: ClassVar[bool] = False  # one process per device (started by train.py or a launcher)
    cuda_graphs: ClassVar[bool] = True  # trainer.compile_mode=reduce-overhead works
    fused_optimizer: ClassVar[bool] = True  # the optimizer's fused CUDA kernels work on its parameters
    channels_last_weights: ClassVar[bool] = True  # weights may be converted to channels_last
    cudnn_benchmark: ClassVar[bool] = True
    averages_gradients: ClassVar[bool] = False  # the sync divides by the world size (DDP's reducer, FSDP)

    # --- before any process starts -------------------------------------------------------------
    def check(self, cfg, device_type: str) -> None:
        """Options that do not fit this strategy, the trainer settings or the device type."""
        if self.sync_bn:
            raise ConfigError(
                f"strategy.sync_bn=true works only with strategy=ddp (SyncBatchNorm needs "
                f"DistributedDataParallel), got strategy={self.name}; drop strategy.sync_bn"
            )
        t = cfg.trainer
        if t.compile_mode == "reduce-overhead" and not self.cuda_graphs:
            raise ConfigError(
                f"trainer.compile_mode=reduce-overhead (CUDA graphs) works with strategy=single or "
                f"ddp, not {self.name}; use trainer.compile_mode=default"
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
            set_model_state_dict(self.core, model_state, options=options)
        else:
            set_state_dict(
                self.core, optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=options
            )

    def save_checkpoint(self, directory: Path, names: list[str], optimizer, state: dict, primary: bool) -> None:
        """Collective: checkpoints `names` ("last", "best") of the model, the optimizer and `state` (the rest).
        Here the full state is gathered and rank 0 writes `<name>.pt` (src/checkpoint.py)."""
        model_state, optim_state = self.state_dict(optimizer)
        if primary:
            ckpt.save_full({"model": model_state, "optimizer": optim_state, **state}, directory, names)

    def load_checkpoint(self, path, optimizer=None) -> dict:
        """Load a checkpoint of either format into the model (and `optimizer`); return the rest of its state.
        From a sharded one each rank reads what its own layout holds, whatever number of ranks wrote it."""
        path = Path(path)
        state = ckpt.load(path)
        shapes = {k: tuple(v.shape) for k, v in get_model_state_dict(self.core).items()}  # no gather
        ckpt.check_compatible(ckpt.saved_shapes(path, state), shapes, path)
        if not path.is_dir():
            self.load_state_dict(state["model"], optimizer, state["optimizer"] if optimizer is not None else None)
            return state
        import torch.distributed.checkpoint as dcp

        if optimizer is None:
            tensors = {"model": get_model_state_dict(self.core)}
        else:  # torch fills a fresh optimizer's state with placeholders for DCP to load into
            tensors = dict(zip(("model", "optimizer"), get_state_dict(self.core, optimizer)))
        with warnings.catch_warnings():  # one process (no process group) reading it is intended
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(tensors, checkpoint_id=path)
        if optimizer is None:
            set_model_state_dict(self.core, tensors["model"])
        else:
            set_state_dict(
                self.core, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optimizer"]
            )
        return state

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The model's blocks, each recomputed as one by activation checkpointing (FSDP: its shard units)."""
        return shard_targets(model, "auto")

    def replicas_agree(self, device: torch.device) -> dict[str, bool]:
        """Are the parameters / BatchNorm running stats identical on every rank? Sharded (FSDP) parameters
        exist once and agree by construction; replicated ones are compared through an all-reduce of max and min."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return {"params_in_sync": True, "bn_buffers_in_sync": True}
        from torch.distributed.tensor import DTensor

        groups = {
            "params_in_sync": [p for p in self.core.parameters() if not isinstance(p, DTensor)],
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


COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # strategy.comm_hook -> all-reduce dtype


@dataclass
class DDP(_Distributed):
    """DistributedDataParallel, or (gradient_sync=after_backward) one flat all-reduce after the backward."""

    bucket_cap_mb: Annotated[float, PositiveReal] = 25
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True  # false: each rank keeps its own BatchNorm running stats (they drift apart)
    comm_hook: Literal["none", "fp16", "bf16"] | None = "none"
    compile_scope: Literal["module", "wrapper"] = "module"
    gradient_sync: Literal["reducer", "after_backward", "auto"] = "auto"

    name: ClassVar[str] = "ddp"

    def check(self, cfg, device_type):
        if self.sync_bn and device_type != "cuda":
            raise ConfigError(
                "strategy.sync_bn=true needs CUDA GPUs (torch's SyncBatchNorm has no CPU "
                "kernel); drop it on CPU, or use model.batch_norm=false"
            )
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
                inner,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                bucket_cap_mb=self.bucket_cap_mb,
                gradient_as_bucket_view=self.gradient_as_bucket_view,
                static_graph=self.static_graph,
                find_unused_parameters=self.find_unused_parameters,
                broadcast_buffers=self.broadcast_buffers,
            )
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
    """FSDP2 (torch.distributed.fsdp.fully_shard) laid out as torchtitan does: each block is one shard unit,
    compiled on its own before it is sharded (trainer.compile), with the next unit's all-gather prefetched
    explicitly; the root holds what no block does (stem, head). Checkpoints are sharded (DCP) by default."""

    shard_modules: Literal["auto"] | list[str] | None = "auto"  # auto: the model's blocks (`shard_targets`)
    reshard_after_forward: bool | Annotated[int, Positive] = True  # int n: regather from groups of n ranks
    prefetch: bool | Annotated[int, Positive] = True  # all-gather the next unit(s) early: true = 1, n = n ahead
    param_dtype: Literal["bf16", "fp32"] | None = None  # null: trainer.amp's dtype with amp, else fp32
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # of the gradient reduce-scatter
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer step on the CPU
    checkpoint_format: Literal["sharded", "full"] = "sharded"

    name: ClassVar[str] = "fsdp"
    cuda_graphs: ClassVar[bool] = False
    fused_optimizer: ClassVar[bool] = False  # the fused kernels do not take DTensor parameters
    channels_last_weights: ClassVar[bool] = False  # FSDP2 cannot shard non-contiguous weights
    averages_gradients: ClassVar[bool] = True

    def processes(self, requested, available, device_type, launched, launched_local):
        world, per_process = super().processes(requested, available, device_type, launched, launched_local)
        group = self.reshard_after_forward
        if not isinstance(group, bool) and world % group:
            divisors = [str(d) for d in range(2, world) if world % d == 0]
            raise ConfigError(
                f"strategy.reshard_after_forward={group} must divide the {world} ranks (the group "
                f"each parameter is regathered from in the backward); use "
                f"{', '.join(['true', 'false', *divisors])}"
            )
        return world, per_process

    def preflight(self, cfg):
        from src.models import build_model

        with torch.device("meta"):
            shard_targets(build_model(cfg.model, num_classes=10, in_channels=3), self.shard_modules)

    def blocks(self, model):
        return shard_targets(model, self.shard_modules)

    def mp_policy(self, ctx: Context):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        param = dtypes[self.param_dtype] if self.param_dtype else ctx.amp_dtype if ctx.amp else None
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=dtypes[self.reduce_dtype])

    def wrap(self, model, ctx):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        units = shard_targets(model, self.shard_modules)
        if ctx.compile:  # one graph per block (repeated blocks share it); FSDP's hooks stay outside the graphs
            limit = torch._dynamo.config.recompile_limit  # a graph per distinct block shape (resnet: ~8)
            torch._dynamo.config.recompile_limit = max(limit, len(units))
            units = [_replace(model, unit, torch.compile(unit, mode=ctx.compile_mode, dynamic=False)) for unit in units]
        options = {
            "mp_policy": self.mp_policy(ctx),
            "offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy(),
        }
        for unit in units:
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(model, **options)  # the root stays gathered from forward to backward: its backward comes first
        ahead = int(self.prefetch)  # the next `ahead` units' all-gathers are issued when a unit's is done
        for i, unit in enumerate([model, *units][:-1] if ahead else []):  # forward: the root, then the units
            unit.set_modules_to_forward_prefetch(units[i : i + ahead])
        for i, unit in enumerate(units[1:] if ahead else [], start=1):  # backward: in reverse order
            unit.set_modules_to_backward_prefetch(units[max(0, i - ahead) : i][::-1])
        self.core = self.model = model
        self.eager = _Eager(model) if ctx.compile else model
        return self.model

    def eval_module(self):
        self.sync_buffers()
        return self.eager

    def sync_context(self, boundary):
        return contextlib.nullcontext() if boundary else _fsdp_no_sync(self.core)

    def sync_buffers(self):
        """FSDP2 leaves buffers (BatchNorm running stats) replicated and unsynchronized: take rank 0's, as
        DDP's broadcast_buffers does, so every rank evaluates with the same weights and stats."""
        if dist.is_initialized():
            _broadcast_from_rank0(self.core, parameters=False)

    def save_checkpoint(self, directory, names, optimizer, state, primary):
        if self.checkpoint_format == "full":
            return super().save_checkpoint(directory, names, optimizer, state, primary)
        self.sync_buffers()  # DCP writes a replicated buffer from one rank, not necessarily rank 0
        model_state, optim_state = get_state_dict(self.core, optimizer)  # this rank's shards: nothing gathered
        ckpt.save_sharded({"model": model_state, "optimizer": optim_state}, state, directory, names, primary)


class _Eager(nn.Module):
    """`module` with its compiled blocks run eagerly: evaluation (no grad, eval-mode norms, an odd last
    batch) would otherwise compile every block again."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        with torch.compiler.set_stance("force_eager"):
            return self.module(x)


@contextlib.contextmanager
def _fsdp_no_sync(core: nn.Module):
    core.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        core.set_requires_gradient_sync(True)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _composite(module: nn.Module) -> bool:
    """A block (layers inside), not a single layer."""
    return any(_has_params(child) for child in module.children())


def _stack(module: nn.Module) -> bool:
    """A Sequential/ModuleList/ModuleDict of several blocks: resnet's layerN, a transformer's blocks."""
    return (
        isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
        and sum(map(_composite, module.children())) > 1
    )


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of the innermost stacks under `module`, and its other composite children; not its single layers."""
    found = []
    for child in module.children():
        if any(_stack(m) for m in child.modules() if m is not child):
            found += _blocks(child)  # finer blocks inside (torchvision's ViT encoder, convnext's stages)
        elif _stack(child):
            found += [block for block in child.children() if _has_params(block)]
        elif _composite(child):
            found.append(child)
    return found


def shard_targets(model: nn.Module, spec) -> list[nn.Module]:
    """The model's blocks, in definition order: each is one FSDP unit (one all-gather, one reduce-scatter) and
    one activation-checkpointing unit; what no block holds (a stem layer, a norm, the classifier) stays in the
    root. auto: the blocks of its innermost stacks (resnet's bottlenecks, ViT's encoder blocks) and its other
    composite children; a list of class names: the outermost modules of those classes."""
    if spec in (None, "auto"):
        targets = _blocks(model)
    else:
        names = set(spec)
        targets = _outermost(model, lambda m: type(m).__name__ in names)
        if not targets:
            found = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"strategy.shard_modules={sorted(names)} matches no module of the model; "
                f"choose among {found[:15]} or use auto"
            )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    # a block under activation checkpointing is sharded and compiled together with its wrapper
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrappers.get(id(t), t) for t in targets]


def _outermost(module: nn.Module, match) -> list[nn.Module]:
    found = []
    for child in module.children():
        found += [child] if match(child) else _outermost(child, match)
    return found


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put `new` where `old` is in `model` (the same attribute or Sequential slot); return `new`."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError(f"{type(old).__name__} is not a sub-module of {type(model).__name__}")


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module] | None = None) -> None:
    """trainer.activation_checkpointing: each block keeps only its input from the forward and recomputes the
    rest in the backward (activation memory of one block at a time, ~1/3 more compute). `blocks`: by default
    `shard_targets(model, "auto")`; the trainer passes `strategy.blocks(model)`, FSDP's units. torch's
    CheckpointWrapper keeps state_dict() names and the checkpoint helpers drop its prefix: a checkpoint saved
    with activation checkpointing loads without it, and back."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = shard_targets(model, "auto") if blocks is None else blocks
    if not blocks:
        raise ConfigError(
            f"trainer.activation_checkpointing=true finds no block in {type(model).__name__} to "
            f"recompute (a child with layers inside); set trainer.activation_checkpointing=false"
        )
    for block in blocks:
        _replace(model, block, checkpoint_wrapper(block, checkpoint_fn=_checkpoint))


def _checkpoint(module: nn.Module, *args, **kwargs):
    """torch.utils.checkpoint of `module`, whose recomputation leaves the buffers as the forward left them
    (BatchNorm would count each batch twice in its running stats). Compiled, the recomputation is part of the
    backward graph and updates nothing."""
    from torch.utils.checkpoint import checkpoint

    if torch.compiler.is_compiling() or not any(True for _ in module.buffers()):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)
    return checkpoint(
        module,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _buffers_kept(module)),
        **kwargs,
    )


@contextlib.contextmanager
def _buffers_kept(module: nn.Module):
    saved = [b.clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)


def _broadcast_from_rank0(module: nn.Module, parameters: bool = True) -> None:
    """What DDP does when it wraps a model: every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*(module.parameters() if parameters else ()), *module.buffers()]:
            dist.broadcast(tensor, src=0)


def build_strategy(cfg) -> Strategy:
    """The strategy object of `cfg.strategy` (its options were checked by src.schema)."""
    from hydra.utils import instantiate

    return instantiate(cfg, _convert_="all")
