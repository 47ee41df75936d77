"""What DataLoader workers do: fetch one piece of a batch, asked as (split, epoch, sample ids), as uint8 images.

In-memory data is cropped and flipped there (`MemoryFetch`); a builder's own Dataset is read as it gives its
samples (`FileFetch`); images read from disk are decoded (`DiskFetch`): on the worker's CPU, cropped there or not,
or on the GPU, each worker in a CUDA context of its own. Whatever a worker ships, the training process finishes
on its device (src/data/finish.py). Workers ship uint8: normalized float32 would be 4x the bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

from src.config.errors import ConfigError
from src.data.augment import Augmentation, EpochDraws, to_device
from src.data.datasets import DataBundle
from src.data.decode import EncodedImages, as_tensor, decode_batch, decode_cpu, gpu_decodable
from src.data.disk_crops import DiskCrops
from src.data.recipes import trivial_augment
from src.state.signals import data_workers_started, leave_stops_to_the_trainer

SPLITS = ("train", "val", "test")
# workers yield a shared core to the training process: descheduled behind them, it leaves its GPU idle
WORKER_NICENESS = 10


class Fetched(NamedTuple):
    """What a worker ships: uint8 images (augmented as far as the worker goes) and what the device needs to
    finish them: labels, sample ids, crop_flip draws (in-memory data: for the cutout), one line per image skipped
    as unreadable. With `shapes` (B x 3), x holds decoded images of those shapes back to back, not yet cropped;
    with `flips` too, each is the region of its training crop, still to be resized (and mirrored where flips)."""

    x: torch.Tensor
    y: torch.Tensor
    ids: torch.Tensor
    params: torch.Tensor | None = None
    skipped: tuple[str, ...] = ()
    shapes: torch.Tensor | None = None
    flips: torch.Tensor | None = None


def _asked(request) -> tuple[str, int | None, torch.Tensor]:
    """(split, epoch or None for an evaluation, sample ids) of a request; a DiskFetch's request also says whether
    to crop. The ids come as a numpy array, pickled by value: a tensor would cross as a file descriptor, one socket
    handshake with the training process per piece (and a worker killed during one printed a traceback there)."""
    return request[0], request[1], torch.from_numpy(request[2])


class MemoryFetch(torch.utils.data.Dataset):
    """In-memory data, a whole micro-batch per fetch: cropped and flipped (then TrivialAugment) on the CPU."""

    def __init__(self, data: DataBundle, augmentation: Augmentation, seed: int):
        self.splits, self.augmentation = {k: getattr(data, k) for k in SPLITS}, augmentation
        self.draws = EpochDraws(augmentation, len(data.train), seed)  # cached per worker

    def __len__(self):
        return len(self.splits["train"])

    def __getitems__(self, request):
        split, epoch, ids = _asked(request)
        params = self.draws(epoch, ids)
        images = self.augmentation.augment(self.splits[split].images[ids], params)
        if epoch is not None and self.augmentation.recipe.trivial:
            images = trivial_augment(images, self.draws.seed, epoch, ids)
        return Fetched(images, self.splits[split].labels[ids], ids, params)


class FileFetch(torch.utils.data.Dataset):
    """A builder's own on-disk Dataset (samples of one size, uint8), read as it gives them."""

    def __init__(self, data: DataBundle):
        self.splits = {k: getattr(data, k) for k in SPLITS}

    def __len__(self):
        return len(self.splits["train"])

    def __getitems__(self, request):
        split, _, ids = _asked(request)
        samples = [self.splits[split].files[i] for i in ids.tolist()]
        return Fetched(torch.stack([s[0] for s in samples]), torch.tensor([s[1] for s in samples]), ids)


def gpu_decoded(ids: torch.Tensor, share: float) -> torch.Tensor:
    """Which samples data.decode=split decodes on the GPU: those whose id hashes below `share`. The choice
    depends on the sample alone (nvjpeg and the CPU decoder differ by a level or two), so every strategy, rank
    count and resume decodes each image the same way."""
    return (ids * 2654435761) % 2**32 < int(share * 2**32)


def _read_or_skip(files: EncodedImages, ids: torch.Tensor, skip: bool, keep) -> tuple[list, list, list[str]]:
    """(kept positions in the batch, keep(data, id) of each, one line per skipped image): an unreadable image
    raises its ConfigError line, or is left out with data.skip_bad_images."""
    kept, out, skipped = [], [], []
    for k, (i, data) in enumerate(zip(ids.tolist(), files.read(ids.tolist()))):
        try:
            if isinstance(data, ConfigError):
                raise data
            out.append(keep(data, i))
            kept.append(k)
        except ConfigError as exc:
            if not skip:
                raise
            skipped.append(str(exc))
    return kept, out, skipped


class DiskFetch(torch.utils.data.Dataset):
    """Images read from disk, a piece of a batch of any split per fetch. device None (data.decode=cpu): decoded
    by this worker's CPU, and cropped here when the request says so (its 4th item). Else decoded on `device`: the
    JPEGs its decoder takes in one batched call (nvjpeg on CUDA), the rest (PNG, CMYK, grayscale, progressive) on
    the CPU. Uncropped images go back to back in one buffer, for the training process to crop (a training crop's
    region only). On CUDA each worker has a CUDA context of its own: nvjpeg waits on the host for each image's
    colour conversion, which behind the step's kernels in one context is ~25x slower; cropping in these workers too
    slowed both them and the step, so the training process crops."""

    def __init__(
        self,
        data: DataBundle,
        crops: DiskCrops,
        device: torch.device | None,
        skip: bool,
        trivial: bool = False,
    ):
        self.splits, self.crops, self.device, self.skip = {k: getattr(data, k) for k in SPLITS}, crops, device, skip
        self.trivial = trivial

    def __len__(self):
        return len(self.splits["train"])

    def __getitems__(self, request):
        split, epoch, ids = _asked(request)
        crop_here = request[3]  # the training process's choice, which data.crop=auto may change mid-run
        files, labels = self.splits[split].files, self.splits[split].labels
        if self.device is None:
            kept, images, skipped = _read_or_skip(
                files, ids, self.skip, lambda data, i: decode_cpu(as_tensor(data), files.name(i))
            )
        else:
            kept, images, skipped = self._decode_on_device(files, ids)
        ids = ids[kept]
        if not images:  # every image skipped (data.skip_bad_images): the training process checks the whole batch
            return Fetched(torch.empty(0, dtype=torch.uint8), labels[ids], ids, skipped=tuple(skipped))
        if crop_here:
            x = self.crops(images, ids, epoch)
            if self.trivial and split == "train" and epoch is not None:
                x = trivial_augment(x, self.crops.seed, epoch, ids)
            return Fetched(x, labels[ids], ids, skipped=tuple(skipped))
        # a training crop's region only, not the whole image: about the crop's bytes cross to the training process
        cut = self.crops.regions(images, ids, epoch)
        images, flips = cut if cut else (images, None)
        packed = torch.cat([image.reshape(-1) for image in images])  # not yet resized, back to back
        if packed.is_cuda:  # the training process reads it as soon as it arrives
            torch.cuda.current_stream(packed.device).synchronize()
        shapes = torch.tensor([tuple(image.shape) for image in images])
        flips = None if flips is None else torch.from_numpy(flips)
        return Fetched(packed, labels[ids], ids, skipped=tuple(skipped), shapes=shapes, flips=flips)

    def _decode_on_device(self, files: EncodedImages, ids: torch.Tensor) -> tuple[list, list, list[str]]:
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)  # the rank's GPU (a worker starts on the first)

        def encoded_or_decoded(data, i):
            return as_tensor(data) if gpu_decodable(data) else decode_cpu(as_tensor(data), files.name(i))

        kept, images, skipped = _read_or_skip(files, ids, self.skip, encoded_or_decoded)
        jpegs = [k for k, image in enumerate(images) if image.dim() == 1]
        decoded = decode_batch([images[k] for k in jpegs], self.device, lambda j: files.name(int(ids[kept[jpegs[j]]])))
        for k, image in zip(jpegs, decoded):
            images[k] = image
        images = [image if isinstance(image, ConfigError) else to_device(image, self.device) for image in images]
        bad = [k for k, image in enumerate(images) if isinstance(image, ConfigError)]
        if bad and not self.skip:
            raise images[bad[0]]
        skipped += [str(images[k]) for k in bad]
        keep = [k for k in range(len(images)) if k not in set(bad)]
        return [kept[k] for k in keep], [images[k] for k in keep], skipped


# --- the DataLoader around a fetch --------------------------------------------------------------------------


class Requests:
    """The batch sampler of a persistent DataLoader: the training process refills it before each pass."""

    def __init__(self):
        self.items: list = []

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)


def _as_fetched(batch):
    return batch


def worker_loader(
    fetch: torch.utils.data.Dataset, requests: Requests, workers: int, pin: bool, spawn: bool
) -> torch.utils.data.DataLoader:
    """A DataLoader of `workers` persistent workers making one Fetched per request. Ranks are started with
    "spawn"; forked workers start in milliseconds and copy no data, but CUDA cannot start in a forked child."""
    return torch.utils.data.DataLoader(
        fetch,
        batch_sampler=requests,
        collate_fn=_as_fetched,
        num_workers=workers,
        pin_memory=pin,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
        multiprocessing_context=("spawn" if spawn else "fork") if workers else None,
        worker_init_fn=_start_worker if workers else None,
    )


def fetching(loader: torch.utils.data.DataLoader) -> Iterator[Fetched]:
    """A pass of the workers over their requests, started now; a bad input found in a worker comes out as its
    one line."""
    return _one_line_errors(data_workers_started(loader))


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
