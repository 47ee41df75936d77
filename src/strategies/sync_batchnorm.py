"""ddp's `sync_bn`: BatchNorm whose training statistics are those of the global batch, summed across ranks by a
functional all-reduce that torch.compile traces into the model's graph.

torch's SyncBatchNorm breaks the compiled graph at every layer (its collectives run outside it), so under
`compile_mode=reduce-overhead` each layer ends a CUDA graph; it also has no CPU kernel. Here the per-rank sums are
ops of the graph: it stays whole, CUDA graphs replay it, and gloo runs it on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

# torch registers the functional all-reduce's gradient itself in newer releases; older ones need _SumOverRanks
_ALL_REDUCE_HAS_GRADIENT = torch._C._dispatch_has_kernel_for_dispatch_key("_c10d_functional::all_reduce", "Autograd")


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over the ranks; its gradient is the sum of the ranks' gradients (each rank's loss
    depends on every rank's part)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return fc.all_reduce(tensor, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return fc.all_reduce(grad.contiguous(), "sum", ctx.group), None


def sum_over_ranks(tensor: torch.Tensor, group) -> torch.Tensor:
    """The sum over the ranks, differentiable. torch's own gradient for the functional all-reduce keeps the compiled
    graph cacheable (a custom autograd.Function makes AOTAutograd's cache pass it by: a recompile every run)."""
    if _ALL_REDUCE_HAS_GRADIENT:
        return fc.all_reduce(tensor, "sum", group)
    return _SumOverRanks.apply(tensor, group)


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batch of every rank together: in training, the mean and variance of all ranks' samples
    (and the running statistics updated from them, so every rank keeps the same ones); in evaluation, as torch's."""

    def __init__(self, *args, group=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size(self.group) == 1:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        count = x.numel() // x.shape[1]
        work = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in float32 at least, as torch's
        var, mean = torch.var_mean(work, dim=dims, correction=0)
        # sums of count, count * mean and count * E[x^2] over the ranks: ranks may hold unequal micro-batches
        local = torch.cat([mean.new_full((1,), count), count * mean, count * (var + mean * mean)])
        total = sum_over_ranks(local, self.group or dist.group.WORLD)
        n, channels = total[0], x.shape[1]
        mean = total[1 : 1 + channels] / n
        var = (total[1 + channels :] / n - mean * mean).clamp_min(0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * n / (n - 1).clamp_min(1))
        shape = [1, channels] + [1] * (x.dim() - 2)
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight
        y = (work - mean.view(shape)) * scale.view(shape)
        if self.bias is not None:
            y = y + self.bias.view(shape)
        return y.to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        self.num_batches_tracked.add_(1)
        # momentum=None: torch's cumulative average
        factor = 1.0 / self.num_batches_tracked.float() if self.momentum is None else self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased_var.to(self.running_var.dtype), factor)


def global_batch_norm(module: nn.Module, group=None) -> nn.Module:
    """`module` with each BatchNorm replaced by a `GlobalBatchNorm` over `group`'s ranks, holding the same
    parameters and buffers (so optimizers, checkpoints and state-dict keys are unchanged)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        synced = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats, group=group
        )
        synced.weight, synced.bias = module.weight, module.bias
        for name, buffer in module.named_buffers(recurse=False):
            setattr(synced, name, buffer)
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, global_batch_norm(child, group))
    return module
