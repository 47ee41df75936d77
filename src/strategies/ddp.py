"""`DDP`: DistributedDataParallel, or its alternative gradient sync, one flat all-reduce after the backward."""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from src.config.schema import PositiveReal
from src.strategies.base import _broadcast_from_rank0, _Distributed
from src.strategies.sync_batchnorm import global_batch_norm

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
    batchnorm_sync: ClassVar[bool] = True

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
            model = global_batch_norm(model)
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
