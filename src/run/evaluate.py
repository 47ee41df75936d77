"""Exact evaluation: sums and counts over every sample, each counted once, all-reduced over ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from src.distributed import all_reduce


def topk_correct(logits: torch.Tensor, target: torch.Tensor, ks=(1, 5)) -> list[torch.Tensor]:
    """Number of samples whose target is among the top-k logits, for each k (k capped at #classes)."""
    kmax = min(max(ks), logits.shape[1])
    top = logits.topk(kmax, dim=1).indices
    hits = top.eq(target[:, None])
    return [hits[:, : min(k, kmax)].any(dim=1).sum() for k in ks]


def tta_views(x: torch.Tensor, flip: bool, shift: int) -> list[torch.Tensor]:
    """The batch as the model sees it at test time: itself; with shift > 0 also moved `shift` pixels
    down-right and up-left (edges filled by reflection); with flip, each of those mirrored too."""
    views = [x]
    if shift:
        padded = F.pad(x, (shift, shift, shift, shift), mode="reflect")
        h, w = x.shape[-2:]
        views += [padded[..., :h, :w], padded[..., 2 * shift :, 2 * shift :]]
    return views + [v.flip(3) for v in views] if flip else views


def tta_logits(model, x: torch.Tensor, autocast, flip_tta: bool, tta_shift: int) -> torch.Tensor:
    """The model's float logits for a batch: the mean over its test-time views."""
    with autocast():
        views = tta_views(x, flip_tta, tta_shift)
        return sum(model(v).float() for v in views) / len(views)


@torch.no_grad()
def evaluate(
    model, batches, device: torch.device, autocast, flip_tta: bool = False, tta_shift: int = 0
) -> dict[str, float]:
    """Loss, top-1 and top-5 (percent) of `model` over the batches of every rank together.
    flip_tta / tta_shift: score each image by the mean logits over its `tta_views`."""
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1, top-5, count
    count = 0
    for x, y in batches:
        logits = tta_logits(model, x, autocast, flip_tta, tta_shift)
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        top1, top5 = topk_correct(logits, y)
        totals[1] += top1
        totals[2] += top5
        count += len(y)  # a host integer: no device sync per batch
    totals[3] = count
    loss_sum, top1, top5, count = all_reduce(totals).tolist()
    count = max(count, 1.0)
    return {"loss": loss_sum / count, "top1": 100 * top1 / count, "top5": 100 * top5 / count, "count": int(count)}
