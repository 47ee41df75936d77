"""The `strategy/` group: single, dp (nn.DataParallel), ddp (DistributedDataParallel), fsdp (FSDP2).

`wrap` returns the module to call in the training loop (compiled with trainer.compile); the bare
module (`core`) keeps the parameter names without `module.` prefixes, so a checkpoint from any
strategy loads in any other.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict, set_state_dict)

from src.config import ConfigError


@dataclass
class Wrapped:
    model: nn.Module     # call this in forward/backward (compiled when trainer.compile)
    core: nn.Module      # parameters / state dicts
    name: str
    wrapper: nn.Module   # the strategy's own wrapper (DDP, DataParallel) or core
    broadcast_buffers: bool = False   # ddp: BatchNorm running stats follow rank 0's
    after_backward: FlatGradientSync | None = None   # ddp with gradient_sync=after_backward

    @property
    def averages_gradients(self) -> bool:
        """DDP's reducer and FSDP average gradients over ranks; the flat all-reduce sums them."""
        return self.after_backward is None

    def sync_gradients(self) -> None:
        """At the end of an optimizer step's last backward: the all-reduce, where the strategy defers it."""
        if self.after_backward is not None:
            self.after_backward()

    def sync_context(self, boundary: bool):
        """Skip the gradient all-reduce on micro-steps that are not the last of an optimizer step."""
        if boundary or self.after_backward is not None:  # after_backward: nothing syncs before it is called
            return contextlib.nullcontext()
        if self.name == "ddp":
            return self.wrapper.no_sync()
        if self.name == "fsdp":
            return _fsdp_no_sync(self.core)
        return contextlib.nullcontext()

    def sync_buffers(self) -> None:
        """What DDP does before each forward (with broadcast_buffers): every rank takes rank 0's buffers
        (BatchNorm running stats). Done before evaluating and before checking that the replicas agree."""
        if self.name == "ddp" and self.broadcast_buffers and dist.is_initialized():
            with torch.no_grad():
                for buffer in self.core.buffers():
                    dist.broadcast(buffer, src=0)

    def eval_module(self) -> nn.Module:
        """The uncompiled module to evaluate with (no-grad mode and an odd last batch would each recompile)."""
        self.sync_buffers()
        return self.wrapper if self.name == "dp" else self.core


COMM_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}  # strategy.comm_hook -> all-reduce dtype


class FlatGradientSync:
    """Every gradient summed over ranks by one all-reduce of one flat buffer, after the whole backward.

    DDP's reducer all-reduces buckets from per-parameter autograd hooks so that communication overlaps
    the backward. When the backward is one CUDA graph (compile_mode=reduce-overhead) every hook fires at
    its end: nothing is left to overlap, and one packed all-reduce after it measured faster in the loop
    (2 x H200: 1.86x vs 1.82x one GPU with DDP's default reducer; cutting the graph at buckets to overlap
    was slower still; bench/results/NOTES.md, sections 8, 9 and 11).
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


def _broadcast_from_rank0(module: nn.Module) -> None:
    """What DDP does when it wraps a model: every rank starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0)


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


def wrap(model: nn.Module, cfg, device: torch.device, amp: bool, amp_dtype: torch.dtype,
         devices_per_process: int = 1, compile: bool = False, compile_mode: str = "default") -> Wrapped:
    name = cfg.name
    compiled = (lambda m: torch.compile(m, mode=compile_mode)) if compile else (lambda m: m)
    if name == "single":
        return Wrapped(compiled(model), model, name, model)
    if name == "dp":
        dp = nn.DataParallel(model, device_ids=list(range(devices_per_process)))
        return Wrapped(compiled(dp), model, name, dp)
    if name == "ddp":
        if cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if ddp_gradient_sync(cfg, compile, compile_mode) == "after_backward":
            _broadcast_from_rank0(model)
            dtype = COMM_DTYPES.get(cfg.get("comm_hook"))
            return Wrapped(compiled(model), model, name, model, broadcast_buffers=cfg.broadcast_buffers,
                           after_backward=FlatGradientSync(model.parameters(), dtype))
        # compile_scope=module: DDP wraps the compiled model (one graph; DDP's hooks stay outside it);
        # wrapper: compile the DDP wrapper (DDPOptimizer cuts the graph at gradient-bucket boundaries)
        scope = cfg.get("compile_scope", "module")
        inner = compiled(model) if scope == "module" else model
        with warnings.catch_warnings():  # newer torch renames broadcast_buffers; keep the name 2.11 knows
            warnings.simplefilter("ignore", FutureWarning)
            ddp = nn.parallel.DistributedDataParallel(
                inner, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cfg.bucket_cap_mb, gradient_as_bucket_view=cfg.gradient_as_bucket_view,
                static_graph=cfg.static_graph, find_unused_parameters=cfg.find_unused_parameters,
                broadcast_buffers=cfg.broadcast_buffers)
        if cfg.get("comm_hook") in COMM_DTYPES:  # halve the bytes of the gradient all-reduce
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, getattr(default_hooks, f"{cfg.comm_hook}_compress_hook"))
        return Wrapped(compiled(ddp) if scope == "wrapper" else ddp, model, name, ddp,
                       broadcast_buffers=cfg.broadcast_buffers)
    if name == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32) if amp else \
            MixedPrecisionPolicy()
        for sub in shard_targets(model, cfg.shard_modules):
            fully_shard(sub, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
        return Wrapped(compiled(model), model, name, model)
    raise ConfigError(f"strategy.name={name!r} is unknown; use single, dp, ddp or fsdp")


def ddp_gradient_sync(cfg, compile: bool, compile_mode: str) -> str:
    """strategy.gradient_sync: reducer (DDP's overlapped buckets) | after_backward | auto (after_backward
    exactly when the backward is one CUDA graph)."""
    choice = cfg.get("gradient_sync", "reducer")
    if choice == "auto":
        return "after_backward" if compile and compile_mode == "reduce-overhead" else "reducer"
    return choice


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state keyed by parameter name (collective under fsdp)."""
    return get_state_dict(wrapped.core, optimizer, options=_FULL)


def load_full_state(wrapped: Wrapped, optimizer: torch.optim.Optimizer | None, model_state: dict,
                    optim_state: dict | None) -> None:
    options = StateDictOptions(full_state_dict=True, strict=True)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(wrapped.core, model_state, options=options)
    else:
        set_state_dict(wrapped.core, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=options)


def replicas_agree(core: nn.Module, device: torch.device) -> dict[str, bool]:
    """Are the parameters / BatchNorm running stats identical on every rank?

    Sharded (FSDP) parameters exist once and agree by construction; replicated tensors are compared
    element-wise through an all-reduce of their max and min.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return {"params_in_sync": True, "bn_buffers_in_sync": True}
    from torch.distributed.tensor import DTensor

    groups = {"params_in_sync": [p for p in core.parameters() if not isinstance(p, DTensor)],
              "bn_buffers_in_sync": [b for n, b in core.named_buffers() if "running_" in n]}
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
