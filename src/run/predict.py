"""`predict=true` (with train=false): each sample's top-5 with probabilities, per-class accuracy and the confusion
matrix of a split, written by rank 0 into `<run dir>/predictions/`."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
import torch.distributed as dist

from src.run.evaluate import tta_logits


@torch.no_grad()
def predict(model, batches, ids: torch.Tensor, autocast, flip_tta: bool = False, tta_shift: int = 0) -> torch.Tensor:
    """One row per sample of `ids` (this rank's, in the order the batches hold them): its index in the split, its
    label, the top-5 classes, their probabilities."""
    model.eval()
    rows = []
    for x, y in batches:
        probs = tta_logits(model, x, autocast, flip_tta, tta_shift).softmax(dim=1)
        top = probs.topk(min(5, probs.shape[1]), dim=1)
        rows.append(torch.cat([y[:, None].double(), top.indices.double(), top.values.double()], dim=1).cpu())
    rows = torch.cat(rows) if rows else torch.zeros(0, 11, dtype=torch.float64)
    return torch.cat([ids[: len(rows), None].double(), rows], dim=1)


def gather_in_rank_order(rows: torch.Tensor) -> torch.Tensor | None:
    """On rank 0, which writes them, every rank's rows, rank 0's first: the order of the split (each rank evaluates
    a contiguous shard); None on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()):
        return rows
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, parts, dst=0)  # the ranks' own tensors, never a user's file
    return torch.cat(parts) if parts is not None else None


def write(out: Path, split: str, rows: torch.Tensor, classes: list[str], names=None) -> dict:
    """`<split>.csv`, `<split>_confusion.png` and a TensorBoard image in `out`; returns per-class top-1 (%).
    names: the sample at an index's file (on-disk data), else None."""
    out.mkdir(parents=True, exist_ok=True)
    index, rows = rows[:, 0].long().tolist(), rows[:, 1:]
    k = (rows.shape[1] - 1) // 2
    labels, top = rows[:, 0].long(), rows[:, 1 : 1 + k].long()
    label = classes.__getitem__ if classes else str
    with open(out / f"{split}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        header = ["index", "file", "label", *(f"top{i}" for i in range(1, k + 1)), *(f"p{i}" for i in range(1, k + 1))]
        writer.writerow(header)
        for i, row in zip(index, rows.tolist()):
            preds = [label(int(c)) for c in row[1 : 1 + k]]
            probs = [f"{p:.6f}" for p in row[1 + k :]]
            writer.writerow([i, names(i) if names else "", label(int(row[0])), *preds, *probs])
    n = len(classes) or int(max(labels.max(), top.max()) + 1)
    confusion = torch.bincount(labels * n + top[:, 0], minlength=n * n).reshape(n, n)  # rows: label, cols: predicted
    per_class = {
        label(c): 100 * confusion[c, c].item() / confusion[c].sum().item() for c in range(n) if confusion[c].sum() > 0
    }
    _plot(out, split, confusion, classes)
    return per_class


def _plot(out: Path, split: str, confusion: torch.Tensor, classes: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch.utils.tensorboard import SummaryWriter

    n = confusion.shape[0]
    fig, ax = plt.subplots(figsize=(min(4 + 0.4 * n, 16), min(3.5 + 0.4 * n, 15)))
    shown = ax.imshow(confusion.numpy(), cmap="Blues")
    fig.colorbar(shown, ax=ax)
    ax.set(title=f"{split}: confusion matrix", xlabel="predicted", ylabel="label")
    if classes and n <= 50:  # beyond that, tick labels would overlap
        ax.set_xticks(range(n), classes, rotation=90)
        ax.set_yticks(range(n), classes)
    fig.tight_layout()
    fig.savefig(out / f"{split}_confusion.png", dpi=100)
    with SummaryWriter(str(out)) as writer:
        writer.add_figure(f"confusion/{split}", fig)  # closes the figure
