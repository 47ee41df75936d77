"""An epoch's numbers: loss and hits kept on the device (no host sync per step), time, data wait; reduced once."""

from __future__ import annotations

import time

import torch

from src.distributed import all_reduce, reduce_max


class EpochMeter:
    def __init__(self, device: torch.device, world_size: int, resumed_totals: torch.Tensor | None = None):
        self.device, self.world_size = device, world_size
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-1 hits, samples
        if resumed_totals is not None:  # a mid-epoch checkpoint holds the sum over ranks: count it once
            self.totals += resumed_totals.to(device)
        self.samples, self.wait = 0, 0.0
        if torch.distributed.is_initialized():  # start the clocks together (rank 0 may still be saving a checkpoint)
            torch.distributed.barrier()
        self.start = time.perf_counter()

    def next(self, batches):
        """The next micro-batch, timing how long the loop waited for it (None at the end)."""
        t0 = time.perf_counter()
        micro = next(batches, None)
        self.wait += time.perf_counter() - t0
        return micro

    def add(self, metrics: torch.Tensor, samples: int) -> None:
        self.totals[:2] += metrics
        self.samples += samples

    def partial_totals(self) -> torch.Tensor:
        """Every rank's sums so far, reduced (collective): what a mid-epoch checkpoint keeps."""
        totals = self.totals.clone()
        totals[2] += self.samples
        return all_reduce(totals)

    def finish(self, images: int) -> dict:
        """The epoch's row (collective): mean loss and top-1 over every rank's samples, the slowest rank's time."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = reduce_max(time.perf_counter() - self.start, self.device)
        wait = all_reduce(torch.tensor([self.wait], dtype=torch.float64, device=self.device)).item() / self.world_size
        loss_sum, hits, count = self.partial_totals().tolist()
        return {
            "train_loss": loss_sum / max(count, 1),
            "train_top1": 100 * hits / max(count, 1),
            "epoch_sec": seconds,
            "images_per_sec": images / max(seconds, 1e-9),
            "data_wait_fraction": wait / max(seconds, 1e-9),
        }
