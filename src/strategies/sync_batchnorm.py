"""ddp's `sync_bn`: BatchNorm whose training statistics are those of the global batch, each rank's gathered by a
functional all-gather that torch.compile traces into the model's graph.

torch's SyncBatchNorm breaks the compiled graph at every layer (its collectives run outside it), so under
`compile_mode=reduce-overhead` each layer ends a CUDA graph; it also has no CPU kernel. Here the gather is an op of
the graph: it stays whole, CUDA graphs replay it, and gloo runs it on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
from torch import nn

# torch's differentiable all-gather (an autograd.Function of ours would make AOTAutograd's cache pass the graph by,
# re-tracing it in every run); torch < 2.12 names it all_gather_tensor_autograd
_GATHER = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd


def gather_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor`, stacked (world x ...), differentiable: the gradient of each rank's part is the sum
    of the ranks' gradients for it."""
    return _GATHER(tensor[None], 0, dist.group.WORLD)


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over the batch of every rank together: in training, the mean and variance of all ranks' samples
    (and the running statistics updated from them, so every rank keeps the same ones); in evaluation, as torch's."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or dist.get_world_size() == 1:
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        work = x.to(torch.promote_types(x.dtype, torch.float32))  # statistics in float32 at least, as torch's
        var, mean = torch.var_mean(work, dim=dims, correction=0)
        # each rank's count, mean and variance, combined as Chan et al.: no E[x^2] - E[x]^2 cancellation
        local = torch.cat([mean.new_full((1,), x.numel() // x.shape[1]), mean, var])
        ranks = gather_over_ranks(local)
        channels = x.shape[1]
        counts, means, variances = ranks[:, :1], ranks[:, 1 : 1 + channels], ranks[:, 1 + channels :]
        n = counts.sum()
        mean = (counts * means).sum(0) / n
        var = (counts * (variances + (means - mean).square())).sum(0) / n
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


def global_batch_norm(module: nn.Module) -> nn.Module:
    """`module` with each BatchNorm replaced by a `GlobalBatchNorm` over all ranks, holding the same
    parameters and buffers (so optimizers, checkpoints and state-dict keys are unchanged)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, GlobalBatchNorm):
        synced = GlobalBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        synced.weight, synced.bias = module.weight, module.bias
        for name, buffer in module.named_buffers(recurse=False):
            setattr(synced, name, buffer)
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, global_batch_norm(child))
    return module
