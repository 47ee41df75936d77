"""An epoch's numbers: loss and hits kept on the device (no host sync per step), time, data wait (the host's and,
on CUDA, the GPU's); reduced once."""

from __future__ import annotations

import collections
import time

import torch

from src.distributed import all_reduce, reduce_max


class GpuDataWait:
    """Seconds the GPU spent between the work queued before a fetch and the work queued after it: idle waiting for
    the batch, or for the loader's own kernels (copies, crops; those of batches from host memory run on a stream of
    the loader's, beside the step before, and count only where the step waits for them). Read from CUDA events,
    without a host sync: when the host fetches while the GPU still runs queued steps, the gap is only the loader's
    kernels. The host's wait counts the fetch even then, so it overstates what data costs the GPU (with CUDA
    graphs, 27 % host wait at 0.95x the ceiling)."""

    def __init__(self):
        self.pending: collections.deque = collections.deque()
        self.seconds = 0.0

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def add(self, before: torch.cuda.Event, after: torch.cuda.Event) -> None:
        self.pending.append((before, after))
        self.collect(wait=False)

    def collect(self, wait: bool = True) -> float:
        """Sum the gaps the GPU has passed (all of them with wait: the caller has synchronized)."""
        while self.pending and (wait or self.pending[0][1].query()):
            before, after = self.pending.popleft()
            self.seconds += before.elapsed_time(after) / 1000
        return self.seconds


class CropProbe:
    """data.crop=auto (LoaderPlan.crop_measured): the share of the time the GPU waited for batches cropped by the
    CPU workers, over an epoch's micro-batches past its first SKIP (compilation, the prefetched queue draining), at
    most WINDOW of them, from the same CUDA events as GpuDataWait. `add` says when the window is complete: at the
    same micro-batch on every rank, so that `wait_fraction` (collective) may agree over them."""

    SKIP, WINDOW, MIN_WINDOW = 20, 60, 8

    def __init__(self, micro_batches: int):
        self.skip = min(self.SKIP, micro_batches // 3)
        self.end = min(self.skip + self.WINDOW, micro_batches)
        self.fetches, self.gaps = 0, []

    @property
    def measures(self) -> bool:
        """Whether this epoch has micro-batches enough for a window (else the next epoch measures)."""
        return self.end - self.skip >= self.MIN_WINDOW

    def add(self, before: torch.cuda.Event, after: torch.cuda.Event) -> bool:
        self.fetches += 1
        if self.skip < self.fetches <= self.end:
            self.gaps.append((before, after))
        return self.measures and self.fetches == self.end

    def wait_fraction(self, device: torch.device, world_size: int) -> float:
        """The GPU's wait over the window, divided by the window's GPU time: the mean over ranks (collective)."""
        self.gaps[-1][1].synchronize()
        waited = sum(before.elapsed_time(after) for before, after in self.gaps)
        span = self.gaps[0][0].elapsed_time(self.gaps[-1][1])
        mine = torch.tensor(waited / max(span, 1e-9), dtype=torch.float64, device=device)
        return float(all_reduce(mine)) / world_size


class EpochMeter:
    def __init__(
        self,
        device: torch.device,
        world_size: int,
        resumed_totals: torch.Tensor | None = None,
        probe: CropProbe | None = None,
    ):
        self.device, self.world_size, self.probe = device, world_size, probe
        self.probed = False  # the probe's window was completed by the last fetch
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, top-1 hits, samples
        if resumed_totals is not None:  # a mid-epoch checkpoint holds the sum over ranks: count it once
            self.totals += resumed_totals.to(device)
        self.samples, self.wait = 0, 0.0
        self.gpu_wait = GpuDataWait() if device.type == "cuda" else None
        if torch.distributed.is_initialized():  # start the clocks together (rank 0 may still be saving a checkpoint)
            torch.distributed.barrier()
        self.start = time.perf_counter()

    def next(self, batches):
        """The next micro-batch, timing how long the loop waited for it (None at the end)."""
        before = self.gpu_wait.mark() if self.gpu_wait else None
        t0 = time.perf_counter()
        micro = next(batches, None)
        self.wait += time.perf_counter() - t0
        if self.gpu_wait:
            after = self.gpu_wait.mark()
            self.gpu_wait.add(before, after)
            self.probed = bool(self.probe and micro is not None and self.probe.add(before, after))
        return micro

    def add(self, metrics: torch.Tensor, samples: int) -> None:
        self.totals[:2] += metrics
        self.samples += samples

    def running_loss(self) -> float:
        """The mean training loss so far as this rank sees it (one host sync): its samples, and a resumed
        checkpoint's sums, which count their samples in totals[2]."""
        loss_sum, resumed = self.totals[[0, 2]].tolist()
        return loss_sum / max(resumed + self.samples, 1)

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
        waits = [self.wait] + ([self.gpu_wait.collect()] if self.gpu_wait else [])
        waits = (all_reduce(torch.tensor(waits, dtype=torch.float64, device=self.device)) / self.world_size).tolist()
        loss_sum, hits, count = self.partial_totals().tolist()
        gpu = {"gpu_data_wait_fraction": waits[1] / max(seconds, 1e-9)} if self.gpu_wait else {}
        return {
            "train_loss": loss_sum / max(count, 1),
            "train_top1": 100 * hits / max(count, 1),
            "epoch_sec": seconds,
            "images_per_sec": images / max(seconds, 1e-9),
            "data_wait_fraction": waits[0] / max(seconds, 1e-9),
            **gpu,
        }


class StepLog:
    """Every `every` optimizer steps: the training loss over the steps since the last log (every rank's samples,
    across an epoch's end too), the lr, the gradient norm and images/s. Read from the epoch meters' device sums
    at the logging step only: one small collective and one host sync per log, none in the steps between."""

    def __init__(self, every: int, device: torch.device):
        self.every, self.device = every, device
        self.meter, self.carried = None, torch.zeros(2, dtype=torch.float64, device=device)
        self.time = time.perf_counter()

    def due(self, step: int) -> bool:
        """The first step and every `every`-th: the curves start where training does, and the first log's one-time
        costs (CUDA loading the norm's kernels: ~0.2 s) fall in the first epoch, not a timed one."""
        return bool(self.every) and (step == 1 or step % self.every == 0)

    def _since(self) -> torch.Tensor:
        """Loss sum and samples of this rank since the last log, in the current meter."""
        samples = torch.tensor(self.meter.samples - self.samples, dtype=torch.float64, device=self.device)
        return torch.stack([self.meter.totals[0] - self.loss, samples])

    def start(self, meter: EpochMeter) -> None:
        """At the start of an epoch (or its resumed part): the last epoch's unlogged steps are carried over."""
        if self.meter is not None:
            self.carried += self._since()
        self.meter = meter
        self._mark()

    def _mark(self) -> None:
        """The current meter's sums: where the next log's figures start."""
        self.loss, self.samples = self.meter.totals[0].clone(), self.meter.samples

    def read(self, grad_norm: torch.Tensor | None) -> dict:
        """Collective: the figures since the last log, the same on every rank."""
        loss_sum, samples = all_reduce(self.carried + self._since()).tolist()
        now = time.perf_counter()
        row = {"loss": loss_sum / max(samples, 1), "images_per_sec": samples / max(now - self.time, 1e-9)}
        if grad_norm is not None:
            row["grad_norm"] = float(grad_norm)
        self.carried.zero_()
        self._mark()
        self.time = now
        return row
