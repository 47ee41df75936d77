"""The training objective of one micro-batch, shared by the training loop and the bench's compute ceiling.

One function, so that torch.compile turns the loss, its gradient and the step's metrics into a few
fused kernels (and, with compile_mode=reduce-overhead, one more CUDA graph) instead of a dozen eager ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def loss_terms(
    logits: torch.Tensor,
    targets: torch.Tensor,
    scale: float,
    label_smoothing: float = 0.0,
    others: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale x the summed cross-entropy: what the backward starts from,
    float64 [summed cross-entropy, top-1 hits]: the metrics to add to the epoch's totals).
    Mixed samples (mixup/cutmix: `others`, `weights`) have the target w * smooth(y) + (1 - w) * smooth(other), timm's
    way; cross-entropy is linear in the target, so that is w * CE(y) + (1 - w) * CE(other). Hits count `targets`,
    the dominant label."""
    if others is None:
        loss_sum = F.cross_entropy(logits.float(), targets, reduction="sum", label_smoothing=label_smoothing)
    else:
        per = [
            F.cross_entropy(logits.float(), t, reduction="none", label_smoothing=label_smoothing)
            for t in (targets, others)
        ]
        loss_sum = (weights * per[0] + (1 - weights) * per[1]).sum()
    hits = (logits.detach().argmax(dim=1) == targets).sum()
    return loss_sum * scale, torch.stack([loss_sum.detach().double(), hits.double()])


def build_loss_terms(compile: bool, mode: str = "default"):
    """`loss_terms`, compiled like the model when trainer.compile is set."""
    return torch.compile(loss_terms, mode=mode) if compile else loss_terms
