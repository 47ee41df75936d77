"""Batches for one rank: the training plan, the device-resident path and the classic DataLoader path
(images read from disk: src/data/disk_loader.py).

`data.batch_size` is the GLOBAL batch of one optimizer step. Each epoch, a permutation drawn from
(seed, epoch) is cut into global batches; each global batch is cut into world_size x accumulate
micro-batches, and rank r takes micro-batch k * world_size + r at micro-step k. So the union over
ranks and micro-steps of a step is exactly the single-device batch of that step.
Evaluation shards each split into contiguous, unpadded pieces: every sample is seen exactly once.
Workers ship uint8 images; normalization (4x the bytes as float32) happens on the training device.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from src.config.errors import ConfigError
from src.data.augment import (
    crop_flip,
    cutout,
    draw_params,
    epoch_generator,
    erase_and_mix,
    normalize,
    normalize_table,
    recipe_draws,
    to_device,
    trivial_augment,
)
from src.data.datasets import DataBundle, Split
from src.state.signals import data_workers_started, leave_stops_to_the_trainer

log = logging.getLogger(__name__)
# data.num_workers=auto: a CPU worker per CPU (at most 16); GPU-decoding workers each hold a CUDA context, and 3
# fed an H100 best (measurements: docs/data.md, docs/performance.md)
AUTO_CPU_WORKERS, AUTO_GPU_DECODING_WORKERS = 16, 3
# workers yield a shared core to the training process: descheduled behind them, it leaves its GPU idle
WORKER_NICENESS = 10


@dataclass
class Step:
    micro: list[torch.Tensor]  # this rank's sample ids, one tensor per micro-step
    global_count: int  # samples in the whole optimizer step, over all ranks


def plan_epoch(
    n: int, global_batch: int, world: int, rank: int, accumulate: int, seed: int, epoch: int, drop_last: bool = False
) -> list[Step]:
    """This rank's steps for one epoch. A short last global batch is kept (split as evenly as possible)
    unless it has fewer samples than world_size x accumulate, or drop_last is set."""
    perm = torch.randperm(n, generator=epoch_generator(seed, epoch, stream=0))
    steps = []
    for start in range(0, n, global_batch):
        batch = perm[start : start + global_batch]
        if len(batch) < world * accumulate or (drop_last and len(batch) < global_batch):
            break
        chunks = torch.tensor_split(batch, world * accumulate)
        steps.append(Step([chunks[k * world + rank] for k in range(accumulate)], len(batch)))
    return steps


def eval_shard(n: int, world: int, rank: int) -> torch.Tensor:
    return torch.tensor_split(torch.arange(n), world)[rank]


@dataclass
class MicroBatch:
    x: torch.Tensor
    y: torch.Tensor
    boundary: bool  # last micro-step of an optimizer step
    global_count: int  # samples in the optimizer step over all ranks
    mix: tuple = ()  # mixup/cutmix: (each sample's other label, the weight of y); y is the dominant label


@dataclass(frozen=True)
class Recipe:
    """Random erasing (its probability) and mixup/cutmix (timm's Mixup, per pair): applied per micro-batch on the
    device; TrivialAugment (auto_augment=trivial): per image in the CPU workers."""

    erasing: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    switch_prob: float = 0.5
    trivial: bool = False

    @classmethod
    def of(cls, cfg) -> Recipe:
        keys = ("random_erasing", "mixup_alpha", "cutmix_alpha", "mix_prob", "mix_switch_prob")
        defaults = {"mix_prob": 1.0, "mix_switch_prob": 0.5}
        numbers = (float(cfg.get(k, defaults.get(k, 0.0))) for k in keys)
        return cls(*numbers, trivial=cfg.get("auto_augment", "none") == "trivial")

    @property
    def mixing(self) -> tuple | None:
        on = self.mix_prob > 0 and (self.mixup_alpha > 0 or self.cutmix_alpha > 0)
        return (self.mixup_alpha, self.cutmix_alpha, self.mix_prob, self.switch_prob) if on else None

    @property
    def on(self) -> bool:
        return bool(self.erasing or self.mixing)

    def draws(self, seed: int, epoch: int, ids: torch.Tensor, size) -> torch.Tensor:
        return recipe_draws(seed, epoch, ids.numpy(), *size, self.erasing, self.mixing)


class _Transform:
    """uint8 images -> normalized float batch, augmented with the epoch's draws; shared by both loaders."""

    def __init__(
        self,
        data: DataBundle,
        channels_last: bool,
        device: torch.device,
        cutout: int = 0,
        pad_mode: str = "zeros",
        recipe: Recipe = Recipe(),
    ):
        self.recipe = recipe
        self.mean = torch.tensor(data.mean, device=device)
        self.std = torch.tensor(data.std, device=device)
        self.table = normalize_table(data.mean, data.std).to(device)
        self.crop_flip = data.augment == "crop_flip"
        if cutout and not self.crop_flip:
            raise ConfigError(
                f"data.cutout={cutout} needs the crop_flip augmentation, but this data uses "
                f"{data.augment!r}; set data.cutout=0"
            )
        self.cutout, self.pad_mode = cutout, pad_mode
        self.image_size = tuple(data.image_size)
        self.channels_last = channels_last

    def draw(self, n: int, seed: int, epoch: int) -> torch.Tensor:
        """The random choices of one epoch for samples 0..n-1 (indexed by sample id)."""
        return draw_params(n, seed, epoch, cutout_within=self.image_size if self.cutout else None)

    def augment(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """uint8 -> uint8: the padded crop and flip (classic loader: in the workers)."""
        if params is not None and self.crop_flip:
            return crop_flip(images, params[:, :3], pad_mode=self.pad_mode)
        return images

    def finish(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """uint8 -> normalized float, cutout, layout (always on the training device)."""
        x = normalize(images, self.mean, self.std, self.table)
        if params is not None and self.crop_flip and self.cutout:
            x = cutout(x, params[:, 3:5], self.cutout)
        return self.layout(x)

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:  # spelled out: torch.compile drops contiguous(memory_format=channels_last)
            return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return x.contiguous()

    def recipe_draws(self, seed: int, epoch: int, ids: torch.Tensor) -> torch.Tensor:
        """The micro-batch's erasing and mixing draws (CPU ids -> CPU tensor)."""
        return self.recipe.draws(seed, epoch, ids, self.image_size)

    def apply_recipe(self, x: torch.Tensor, y: torch.Tensor, draws: torch.Tensor | None) -> tuple:
        """(x, y, mix) of a finished training micro-batch: erased and mixed where the recipe says."""
        if draws is None:
            return x, y, ()
        x, y, mix = erase_and_mix(x, y, draws, mix=self.recipe.mixing is not None)
        return self.layout(x), y, mix

    def __call__(self, images: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        return self.finish(self.augment(images, params), params)


class _EpochDraws:
    """The epoch's augmentation draws of a split (indexed by sample id), drawn once per epoch."""

    def __init__(self, transform: _Transform, n: int, seed: int, device: torch.device | None = None):
        self.transform, self.n, self.seed, self.device = transform, n, seed, device
        self.cached: tuple[int | None, torch.Tensor | None] = (None, None)

    def __call__(self, epoch: int | None, ids: torch.Tensor) -> torch.Tensor | None:
        if epoch is None or not self.transform.crop_flip:
            return None
        if self.cached[0] != epoch:
            draws = self.transform.draw(self.n, self.seed, epoch)
            self.cached = (epoch, draws if self.device is None else draws.to(self.device))
        return self.cached[1][ids.to(self.cached[1].device)]


class DeviceLoader:
    """The whole dataset lives on the device as uint8; augmentation runs there, batched."""

    name = "gpu"
    from_disk = False  # the data lives on the device
    num_workers = 0  # no worker processes: every loader says how many it runs (hparams)
    gpu_share = 0.0  # and which share of each batch GPU-decoding workers decode beside CPU ones (data.decode=split)

    def __init__(
        self,
        data: DataBundle,
        device: torch.device,
        channels_last: bool,
        seed: int,
        cutout: int = 0,
        compile: bool = False,
        pad_mode: str = "zeros",
        recipe: Recipe = Recipe(),
    ):
        self.device, self.seed = device, seed
        self.splits = {
            k: (getattr(data, k).images.to(device), getattr(data, k).labels.to(device))
            for k in ("train", "val", "test")
        }
        self.transform = _Transform(data, channels_last, device, cutout, pad_mode, recipe)
        # compiled: gather, crop, flip, normalize, cutout and layout become two kernels instead of ~15
        self._train_batch = torch.compile(self._augmented, dynamic=False) if compile else self._augmented
        self._ready = None  # (epoch, number of steps, augmentation draws, sample ids, recipe draws) prepared ahead

    def _augmented(self, images, labels, params, ids, recipe):
        return self.transform.apply_recipe(self.transform(images[ids], params[ids]), labels[ids], recipe)

    def prepare(self, steps: list[Step], epoch: int, evals: Sequence = ()) -> None:
        """Draw an epoch's augmentation and copy its sample ids to the device now. The trainer calls this
        for the next epoch once this epoch's last step is queued, so the host work overlaps the device's."""
        params = self.transform.draw(len(self.splits["train"][1]), self.seed, epoch).to(self.device)
        # one host-to-device copy per epoch: per-batch copies of pageable memory would stall the host
        ids = torch.cat([ids for step in steps for ids in step.micro]).to(self.device) if steps else None
        recipe = None
        if steps and self.transform.recipe.on:  # drawn per micro-batch (its pairs), copied once
            draws = [self.transform.recipe_draws(self.seed, epoch, ids) for step in steps for ids in step.micro]
            recipe = torch.cat(draws).to(self.device)
        self._ready = (epoch, len(steps), params, ids, recipe)

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        images, labels = self.splits["train"]
        if not (self._ready and self._ready[:2] == (epoch, len(steps))):  # (a resumed epoch has fewer steps)
            self.prepare(steps, epoch)
        _, _, params, all_ids, all_recipe = self._ready
        self._ready = None
        offset = 0
        for step in steps:
            for k, ids in enumerate(step.micro):
                part = slice(offset, offset + len(ids))
                offset += len(ids)
                recipe = None if all_recipe is None else all_recipe[part]
                x, y, mix = self._train_batch(images, labels, params, all_ids[part], recipe)
                yield MicroBatch(x, y, k == len(step.micro) - 1, step.global_count, mix)

    def close(self) -> None:
        self.splits = {}

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        images, labels = self.splits[split]
        for chunk in ids.to(self.device).split(batch_size):
            yield self.transform(images[chunk], None), labels[chunk]


class _Batch(NamedTuple):
    """What a worker ships: uint8 images (augmented as far as the worker goes) and what the device needs to
    finish them: labels, augmentation draws (cutout), sample ids, one line per image skipped as unreadable.
    With `shapes` (B x 3), x holds decoded images of those shapes back to back, not yet cropped; with `flips` too,
    each is the region of its training crop, still to be resized (and mirrored where flips)."""

    x: torch.Tensor
    y: torch.Tensor
    params: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    skipped: tuple[str, ...] = ()
    shapes: torch.Tensor | None = None
    flips: torch.Tensor | None = None


class _MemoryBatches(torch.utils.data.Dataset):
    """Worker side of the classic path for in-memory data: a whole micro-batch per fetch."""

    def __init__(self, split: Split, transform: _Transform, seed: int):
        self.split, self.transform = split, transform
        self.draws = _EpochDraws(transform, len(split), seed)  # cached per worker

    def __len__(self):
        return len(self.split)

    def __getitems__(self, request):
        epoch, ids = request[0], torch.from_numpy(request[1])
        params = self.draws(epoch, ids)
        images = self.transform.augment(self.split.images[ids], params)
        if epoch is not None and self.transform.recipe.trivial:
            images = trivial_augment(images, self.draws.seed, epoch, ids)
        return _Batch(images, self.split.labels[ids], params)


class _FileBatches(torch.utils.data.Dataset):
    """Worker side of the classic path for a builder's own on-disk Dataset (samples of one size, uint8)."""

    def __init__(self, split: Split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitems__(self, request):
        samples = [self.split.files[i] for i in request[1].tolist()]
        return _Batch(torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples]))


def _first(batch):
    return batch


class _Requests:
    """The batch sampler of a persistent DataLoader: the main process refills it before each pass."""

    def __init__(self):
        self.items: list = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


def _epoch_batches(steps: list[Step]) -> list[torch.Tensor]:
    """An epoch's batches of sample ids, in the order the loop takes them: each step's micro-batches."""
    return [ids for step in steps for ids in step.micro]


def _eval_batches(ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return list(ids.split(batch_size))


class _Ahead:
    """Pieces sent to the workers before the trainer asks for them, as one pass: segments (split, epoch, batches
    of sample ids), taken in order. A segment asked for differently, or one left half taken, ends it."""

    def __init__(self, loader_key: str, segments: list, fetched: Iterator):
        self.loader_key, self.segments, self.fetched, self.owed = loader_key, collections.deque(segments), fetched, 0

    def take(self, split: str, epoch: int | None, batches: list[torch.Tensor], pieces: int) -> Iterator | None:
        """The `pieces` fetched pieces of these batches, if they are the next segment; else None."""
        if self.owed or not self.segments:
            return None
        want, when, sent = self.segments[0]
        same = (want, when, len(sent)) == (split, epoch, len(batches)) and all(map(torch.equal, sent, batches))
        if not same:
            return None
        self.segments.popleft()
        self.owed = pieces
        return self._give()

    def _give(self) -> Iterator:
        while self.owed:
            item = next(self.fetched)
            self.owed -= 1
            yield item


class ClassicLoader:
    """torch DataLoader with worker processes, pinned memory and prefetching."""

    name = "classic"
    gpu_share = 0.0  # DiskLoader's data.decode=split sets it
    one_loader_for_all_splits = False  # DiskLoader: one set of workers serves every split

    def __init__(
        self,
        data: DataBundle,
        device: torch.device,
        channels_last: bool,
        num_workers: int,
        seed: int,
        cutout: int = 0,
        pad_mode: str = "zeros",
        recipe: Recipe = Recipe(),
    ):
        self.device, self.seed = device, seed
        if recipe.trivial and not data.in_memory:  # a builder's own Dataset: its workers do not augment
            raise ConfigError(
                f"data.auto_augment=trivial runs in the workers of in-memory data, ImageFolders and shards, not in "
                f"data={data.name!r}'s own on-disk Dataset; set data.auto_augment=none"
            )
        cpu = _Transform(data, False, torch.device("cpu"), cutout, pad_mode, recipe)
        # normalizes, erases and mixes on the device
        self.transform = _Transform(data, channels_last, device, cutout, pad_mode, recipe)
        self.datasets = {
            k: (_MemoryBatches(getattr(data, k), cpu, seed) if data.in_memory else _FileBatches(getattr(data, k)))
            for k in ("train", "val", "test")
        }
        self.num_workers = num_workers
        self.from_disk = not data.in_memory  # each batch read (and decoded) from files
        self.pin = device.type == "cuda"
        self.requests = {k: _Requests() for k in self.datasets}
        self.loaders: dict[str, torch.utils.data.DataLoader] = {}
        self.ahead: _Ahead | None = None

    def _loader(self, split: str, requests: list) -> torch.utils.data.DataLoader:
        """One DataLoader per split, its workers kept alive between epochs (persistent_workers)."""
        self.requests[split].items = requests
        if split not in self.loaders:
            self.loaders[split] = self._data_loader(self.datasets[split], self.requests[split])
        return self.loaders[split]

    def _data_loader(
        self, dataset, requests: _Requests, start: str = "fork", workers: int | None = None, pin: bool | None = None
    ) -> torch.utils.data.DataLoader:
        """A DataLoader of `workers` (self.num_workers) persistent workers fetching whole micro-batches
        (`requests`), pinning them where `pin` (self.pin). Ranks are started with "spawn"; forked workers start in
        milliseconds and copy no data."""
        workers = self.num_workers if workers is None else workers
        return torch.utils.data.DataLoader(
            dataset,
            batch_sampler=requests,
            collate_fn=_first,
            num_workers=workers,
            pin_memory=self.pin if pin is None else pin,
            prefetch_factor=4 if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context=start if workers else None,
            worker_init_fn=_start_worker if workers else None,
        )

    def close(self) -> None:
        """Stop the persistent workers now, not at interpreter exit (seen: a run with CUDA graphs whose
        process did not exit while they were alive)."""
        for loader in self.loaders.values():
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self.loaders.clear()
        self.ahead = None

    def prepare(self, steps: list[Step], epoch: int, evals: Sequence[tuple[str, torch.Tensor, int]] = ()) -> None:
        """Send the workers now what the trainer takes next: the evaluations `evals` (split, sample ids, batch
        size) where the training's workers make them too, then the epoch `steps`. The trainer calls this once an
        epoch's last step is queued, so the next epoch starts with batches made."""
        if not self.num_workers:
            return
        segments = [(s, None, _eval_batches(ids, size)) for s, ids, size in evals if self.one_loader_for_all_splits]
        segments.append(("train", epoch, _epoch_batches(steps)))
        requests = [
            self._request(split, when, piece)
            for split, when, batches in segments
            for pieces in self._pieces(batches)
            for piece in pieces
        ]
        self.ahead = _Ahead(self._loader_key("train"), segments, self._pass("train", requests))

    def _loader_key(self, split: str) -> str:
        return "all" if self.one_loader_for_all_splits else split

    def _finish(self, batch: _Batch, split: str, epoch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A worker's uint8 batch -> the normalized float batch on the device."""
        params = None if batch.params is None else batch.params.to(self.device, non_blocking=True)
        x = self.transform.finish(batch.x.to(self.device, non_blocking=True), params)
        return x, batch.y.to(self.device, non_blocking=True)

    def _piece_size(self, n: int) -> int:
        """Images per fetch for a batch of n: a whole batch (one worker makes it)."""
        return n

    def _join(self, pieces: list[_Batch]) -> _Batch:
        return pieces[0]

    def _pieces(self, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """Each batch of sample ids cut into the pieces one worker makes (_piece_size)."""
        return [ids.split(max(1, self._piece_size(len(ids)))) for ids in batches]

    def _batches(self, split: str, epoch: int | None, batches: list[torch.Tensor]) -> Iterator[tuple]:
        """The finished (x, y) of each batch of sample ids, fetched in pieces of _piece_size and joined again:
        from the pass `prepare` started where it holds them next."""
        pieces = self._pieces(batches)
        fetched = self.ahead.take(split, epoch, batches, sum(map(len, pieces))) if self.ahead else None
        if fetched is None:
            if self.ahead and self.ahead.loader_key == self._loader_key(split):
                self.ahead = None  # the new pass below replaces it on the same workers
            fetched = self._fetch(split, epoch, [piece for batch in pieces for piece in batch])
        for batch in pieces:
            yield self._finish(self._join([next(fetched) for _ in batch]), split, epoch)

    def _request(self, split: str, epoch: int | None, piece: torch.Tensor) -> tuple:
        """What a worker is sent for one piece. The ids go as a numpy array, pickled by value: a tensor would cross
        as a file descriptor, one socket handshake with this process per piece (and a worker killed during one
        printed a traceback here)."""
        return epoch, piece.numpy()

    def _fetch(self, split: str, epoch: int | None, pieces: list[torch.Tensor], **which) -> Iterator[_Batch]:
        """What the workers (of self._loader(split, ..., **which)) make of each piece of sample ids, in order."""
        return self._pass(split, [self._request(split, epoch, piece) for piece in pieces], **which)

    def _pass(self, split: str, requests: list, **which) -> Iterator[_Batch]:
        """A pass of the workers over `requests`, started now; a bad input found in a worker comes out as its
        one line."""
        return _one_line_errors(data_workers_started(self._loader(split, requests, **which)))

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        batches = self._batches("train", epoch, _epoch_batches(steps))
        on = self.transform.recipe.on
        for step in steps:
            for k, ids in enumerate(step.micro):
                x, y = next(batches)
                draws = to_device(self.transform.recipe_draws(self.seed, epoch, ids), self.device) if on else None
                x, y, mix = self.transform.apply_recipe(x, y, draws)
                yield MicroBatch(x, y, k == len(step.micro) - 1, step.global_count, mix)

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        yield from self._batches(split, None, _eval_batches(ids, batch_size))


def _start_worker(worker_id: int) -> None:
    """Each DataLoader worker runs below the training process's priority and leaves its stop signals to it."""
    os.nice(WORKER_NICENESS)
    leave_stops_to_the_trainer(worker_id)


def _one_line_errors(loader) -> Iterator:
    """A bad input found in a worker (e.g. an unreadable image) comes back wrapped in the worker's traceback;
    keep its own one line."""
    try:
        yield from loader
    except ConfigError as exc:
        last = str(exc).strip().splitlines()[-1]
        raise ConfigError(last.split("ConfigError: ", 1)[-1]) from None
    except (ConnectionError, EOFError) as exc:
        died = dead_workers(loader)
        if died is None:
            raise
        raise died from exc


def dead_workers(fetching, grace: float = 2.0) -> RuntimeError | None:
    """A batch crosses from a worker as a file descriptor, fetched over a socket from that worker: when the worker
    is killed during the handover, the socket error reaches this process before the worker is seen to be dead.
    Wait up to `grace` s for that, and say it in torch's words (what src/run/trainer.py reports as a dead worker).
    `fetching`: the DataLoader's iterator, as _one_line_errors holds it."""
    workers = getattr(fetching, "_workers", [])
    deadline = time.monotonic() + grace
    while not (dead := [w.pid for w in workers if not w.is_alive()]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return RuntimeError(f"DataLoader worker (pid(s) {', '.join(map(str, dead))}) exited unexpectedly") if dead else None


def cpus_of_this_process(local_processes: int) -> int:
    """The CPUs this training process may use. The training processes of a node share its CPUs unless the
    launcher bound each to its own (e.g. SLURM's --cpus-per-task: an affinity no larger than one process's share)."""
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none
    if local_processes > 1 and mine > (os.cpu_count() or mine) // local_processes:
        return max(1, mine // local_processes)
    return mine


def resolve_workers(
    value, device: torch.device, in_memory: bool, decode_on_device: bool, local_processes: int, split: bool = False
) -> int:
    """data.num_workers: an integer as given; auto: this process's CPUs but one (left to it), at most
    AUTO_CPU_WORKERS (AUTO_GPU_DECODING_WORKERS when the workers decode on the GPU); none for data in memory on a
    CPU device, where workers would take the cores the training step runs on. split (data.decode=split): the CPU
    workers, beside AUTO_GPU_DECODING_WORKERS that decode on the GPU and take CPUs too."""
    if value != "auto":
        return value
    if in_memory and device.type == "cpu":
        return 0
    cpus = cpus_of_this_process(local_processes)
    beside = AUTO_GPU_DECODING_WORKERS if split else 0  # they take CPUs too (file reads, nvjpeg's host stage)
    cap = AUTO_GPU_DECODING_WORKERS if decode_on_device else AUTO_CPU_WORKERS
    workers = max(1 if split else 0, min(cpus - 1 - beside, cap))
    also = f" and {beside} decoding on the GPU" if split else ""
    log.info(
        "data.num_workers=auto: %d DataLoader workers%s (%d CPUs for this process, one kept for it)",
        workers,
        also,
        cpus,
    )
    return workers
