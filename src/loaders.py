"""Batches for one rank: the training plan, the classic DataLoader path and the device-resident path.

`data.batch_size` is the GLOBAL batch of one optimizer step. Each epoch, a permutation drawn from
(seed, epoch) is cut into global batches; each global batch is cut into world_size x accumulate
micro-batches, and rank r takes micro-batch k * world_size + r at micro-step k. So the union over
ranks and micro-steps of a step is exactly the single-device batch of that step.
Evaluation shards each split into contiguous, unpadded pieces: every sample is seen exactly once.
Workers ship uint8 images; normalization (4x the bytes as float32) happens on the training device.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from src.augment import DiskCrops, crop_flip, cutout, draw_params, epoch_generator, normalize, normalize_table
from src.config import ConfigError
from src.datasets import DataBundle, Split
from src.decode import EncodedImages, as_tensor, decode_batch, decode_cpu, gpu_decodable

log = logging.getLogger(__name__)


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


class _Transform:
    """uint8 images -> normalized float batch, augmented with the epoch's draws; shared by both loaders."""

    def __init__(
        self, data: DataBundle, channels_last: bool, device: torch.device, cutout: int = 0, pad_mode: str = "zeros"
    ):
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
        if self.channels_last:  # spelled out: torch.compile drops contiguous(memory_format=channels_last)
            return x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return x.contiguous()

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

    def __init__(
        self,
        data: DataBundle,
        device: torch.device,
        channels_last: bool,
        seed: int,
        cutout: int = 0,
        compile: bool = False,
        pad_mode: str = "zeros",
    ):
        self.device, self.seed = device, seed
        self.splits = {
            k: (getattr(data, k).images.to(device), getattr(data, k).labels.to(device))
            for k in ("train", "val", "test")
        }
        self.transform = _Transform(data, channels_last, device, cutout, pad_mode)
        # compiled: gather, crop, flip, normalize, cutout and layout become two kernels instead of ~15
        self._train_batch = torch.compile(self._augmented, dynamic=False) if compile else self._augmented
        self._ready = None  # (epoch, number of steps, augmentation draws, sample ids) prepared ahead

    def _augmented(self, images, labels, params, ids):
        return self.transform(images[ids], params[ids]), labels[ids]

    def prepare(self, steps: list[Step], epoch: int) -> None:
        """Draw an epoch's augmentation and copy its sample ids to the device now. The trainer calls this
        for the next epoch once this epoch's last step is queued, so the host work overlaps the device's."""
        params = self.transform.draw(len(self.splits["train"][1]), self.seed, epoch).to(self.device)
        # one host-to-device copy per epoch: per-batch copies of pageable memory would stall the host
        ids = torch.cat([ids for step in steps for ids in step.micro]).to(self.device) if steps else None
        self._ready = (epoch, len(steps), params, ids)

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        images, labels = self.splits["train"]
        if not (self._ready and self._ready[:2] == (epoch, len(steps))):  # (a resumed epoch has fewer steps)
            self.prepare(steps, epoch)
        _, _, params, all_ids = self._ready
        self._ready = None
        offset = 0
        for step in steps:
            for k, ids in enumerate(step.micro):
                on_device = all_ids[offset : offset + len(ids)]
                offset += len(ids)
                x, y = self._train_batch(images, labels, params, on_device)
                yield MicroBatch(x, y, k == len(step.micro) - 1, step.global_count)

    def close(self) -> None:
        self.splits = {}

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        images, labels = self.splits[split]
        for chunk in ids.to(self.device).split(batch_size):
            yield self.transform(images[chunk], None), labels[chunk]


class _Batch(NamedTuple):
    """What a worker ships: uint8 images (augmented as far as the worker goes) and what the device needs to
    finish them: labels, augmentation draws (cutout), sample ids, one line per image skipped as unreadable."""

    x: torch.Tensor
    y: torch.Tensor
    params: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    skipped: tuple[str, ...] = ()


class _Encoded(NamedTuple):
    """A worker's batch for the device to decode: images back to back in `blob` (offsets: B + 1), each an
    encoded JPEG (shape row 0, 0, 0) or, where the device decoder cannot take it, uint8 pixels of that shape."""

    blob: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor
    y: torch.Tensor
    ids: torch.Tensor
    skipped: tuple[str, ...] = ()


class _MemoryBatches(torch.utils.data.Dataset):
    """Worker side of the classic path for in-memory data: a whole micro-batch per fetch."""

    def __init__(self, split: Split, transform: _Transform, seed: int):
        self.split, self.transform = split, transform
        self.draws = _EpochDraws(transform, len(split), seed)  # cached per worker

    def __len__(self):
        return len(self.split)

    def __getitems__(self, request):
        epoch, ids = request
        params = self.draws(epoch, ids)
        return _Batch(self.transform.augment(self.split.images[ids], params), self.split.labels[ids], params)


class _FileBatches(torch.utils.data.Dataset):
    """Worker side of the classic path for a builder's own on-disk Dataset (samples of one size, uint8)."""

    def __init__(self, split: Split):
        self.split = split

    def __len__(self):
        return len(self.split)

    def __getitems__(self, request):
        _, ids = request
        samples = [self.split.files[i] for i in ids.tolist()]
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


class ClassicLoader:
    """torch DataLoader with worker processes, pinned memory and prefetching."""

    name = "classic"

    def __init__(
        self,
        data: DataBundle,
        device: torch.device,
        channels_last: bool,
        num_workers: int,
        seed: int,
        cutout: int = 0,
        pad_mode: str = "zeros",
    ):
        self.device = device
        cpu = _Transform(data, channels_last=False, device=torch.device("cpu"), cutout=cutout, pad_mode=pad_mode)
        self.transform = _Transform(data, channels_last, device, cutout, pad_mode)  # normalizes on the device
        self.datasets = {
            k: (_MemoryBatches(getattr(data, k), cpu, seed) if data.in_memory else _FileBatches(getattr(data, k)))
            for k in ("train", "val", "test")
        }
        self.num_workers = num_workers
        self.pin = device.type == "cuda"
        self.requests = {k: _Requests() for k in self.datasets}
        self.loaders: dict[str, torch.utils.data.DataLoader] = {}

    def _loader(self, split: str, requests: list) -> torch.utils.data.DataLoader:
        """One DataLoader per split, its workers kept alive between epochs (persistent_workers)."""
        self.requests[split].items = requests
        if split not in self.loaders:
            workers = self.num_workers
            self.loaders[split] = torch.utils.data.DataLoader(
                self.datasets[split],
                batch_sampler=self.requests[split],
                collate_fn=_first,
                num_workers=workers,
                pin_memory=self.pin,
                prefetch_factor=4 if workers else None,
                persistent_workers=workers > 0,
                # ranks are started with "spawn"; forked workers start in milliseconds and copy no data
                multiprocessing_context="fork" if workers else None,
            )
        return self.loaders[split]

    def close(self) -> None:
        """Stop the persistent workers now, not at interpreter exit (seen: a run with CUDA graphs whose
        process did not exit while they were alive)."""
        for loader in self.loaders.values():
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self.loaders.clear()

    def prepare(self, steps: list[Step], epoch: int) -> None:
        """Nothing to do ahead: the workers prefetch."""

    def _finish(self, batch: _Batch, split: str, epoch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A worker's uint8 batch -> the normalized float batch on the device."""
        params = None if batch.params is None else batch.params.to(self.device, non_blocking=True)
        x = self.transform.finish(batch.x.to(self.device, non_blocking=True), params)
        return x, batch.y.to(self.device, non_blocking=True)

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        requests = [(epoch, ids) for step in steps for ids in step.micro]
        flat = _one_line_errors(self._loader("train", requests))
        for step in steps:
            for k in range(len(step.micro)):
                x, y = self._finish(next(flat), "train", epoch)
                yield MicroBatch(x, y, k == len(step.micro) - 1, step.global_count)

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        for batch in _one_line_errors(self._loader(split, [(None, chunk) for chunk in ids.split(batch_size)])):
            yield self._finish(batch, split, None)


# --- images read from disk ---------------------------------------------------------------------------


def _check_some_left(images: list) -> None:
    if not images:  # possible only with data.skip_bad_images
        raise ConfigError("every image of a batch was unreadable (data.skip_bad_images=true); check the data")


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


class _DiskBatches(torch.utils.data.Dataset):
    """Worker side for images read from disk (src/decode.py), a micro-batch per fetch. decode_here
    (data.decode=cpu): decoded and cropped here, shipped as uint8 crops. Else only read: shipped encoded for the
    device to decode, but for images its decoder cannot take (PNG, CMYK, grayscale, progressive), decoded here."""

    def __init__(self, split: Split, crops: DiskCrops, decode_here: bool, skip: bool):
        self.split, self.crops, self.decode_here, self.skip = split, crops, decode_here, skip

    def __len__(self):
        return len(self.split)

    def __getitems__(self, request):
        epoch, ids = request
        files = self.split.files
        if self.decode_here:
            kept, images, skipped = _read_or_skip(
                files, ids, self.skip, lambda data, i: decode_cpu(as_tensor(data), files.name(i))
            )
            ids = ids[kept]
            _check_some_left(images)
            return _Batch(self.crops(images, ids, epoch), self.split.labels[ids], ids=ids, skipped=tuple(skipped))

        def encoded_or_pixels(data, i):
            if gpu_decodable(data):
                return data, (0, 0, 0)
            image = decode_cpu(as_tensor(data), files.name(i))
            return memoryview(image.contiguous().numpy()).cast("B"), tuple(image.shape)

        kept, parts, skipped = _read_or_skip(files, ids, self.skip, encoded_or_pixels)
        blob = bytearray()
        for data, _ in parts:
            blob += data
        offsets = np.cumsum([0] + [len(data) for data, _ in parts])
        ids = ids[kept]
        return _Encoded(
            as_tensor(blob),
            torch.from_numpy(offsets),
            torch.tensor([s for _, s in parts]).view(-1, 3),
            self.split.labels[ids],
            ids,
            tuple(skipped),
        )


class DiskLoader(ClassicLoader):
    """Images read from disk by DataLoader workers (an ImageFolder too big for memory, packed shards).
    data.decode=cpu: the workers decode and crop (the "classic" path); gpu: they only read the files, and each
    batch is decoded at once on the device (nvjpeg), cropped and resized there, on a side CUDA stream so it
    overlaps the model's step. Either way uint8 reaches the device, which normalizes."""

    def __init__(self, data: DataBundle, cfg, device: torch.device, channels_last: bool, seed: int, on_device: bool):
        self.device, self.on_device, self.num_workers = device, on_device, cfg.get("num_workers", 0)
        self.name = "gpudecode" if on_device else "classic"
        self.skip = bool(cfg.get("skip_bad_images", False))
        self.crops = DiskCrops(
            data.image_size,
            data.augment == "random_resized_crop",
            seed,
            cfg.get("rrc_scale", (0.08, 1.0)),
            cfg.get("rrc_ratio", (3 / 4, 4 / 3)),
        )
        self.transform = _Transform(data, channels_last, device, cfg.get("cutout", 0), cfg.get("pad_mode", "zeros"))
        self.draws = _EpochDraws(self.transform, len(data.train), seed, device)
        self.files = {k: getattr(data, k).files for k in ("train", "val", "test")}
        self.datasets = {k: _DiskBatches(getattr(data, k), self.crops, not on_device, self.skip) for k in self.files}
        self.pin = device.type == "cuda" and not on_device  # encoded bytes go to nvjpeg from pageable memory
        self.requests = {k: _Requests() for k in self.datasets}
        self.loaders = {}
        self.skipped = 0
        # high priority: the crops are hundreds of small kernels in a row; at normal priority each waits for the
        # model's large kernels to drain from the SMs, and a batch took as long as a training step
        self.stream = torch.cuda.Stream(device, priority=-1) if on_device and device.type == "cuda" else None
        self._done: torch.cuda.Event | None = None  # the side stream's last batch

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        if not self.on_device:
            yield from super().train_batches(steps, epoch)
            return
        requests = [(epoch, ids) for step in steps for ids in step.micro]
        flat = self._decoded_ahead(self._loader("train", requests), "train", epoch)
        try:
            for step in steps:
                for k in range(len(step.micro)):
                    x, y = next(flat)
                    yield MicroBatch(x, y, k == len(step.micro) - 1, step.global_count)
        finally:
            flat.close()  # stops the decoding thread now, also when the loop leaves early

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        if not self.on_device:
            yield from super().eval_batches(split, ids, batch_size)
            return
        yield from self._decoded_ahead(self._loader(split, [(None, c) for c in ids.split(batch_size)]), split, None)

    def _decoded_ahead(self, loader, split: str, epoch: int | None) -> Iterator[tuple]:
        """The loader's batches decoded and cropped in a thread, a few ahead of the training thread: nvjpeg
        parses each JPEG on the host and the crops are launched per image, so in the training thread they
        would take turns with the step's launches instead of overlapping them."""
        workers = iter(loader)  # here: the DataLoader forks its workers from this thread, never from the other
        cuda = self.stream is not None
        index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) if cuda else None

        def decoded():
            if cuda:
                torch.cuda.set_device(index)  # the current device is per thread
            for batch in _one_line_errors(workers):
                yield self._on_side_stream(batch, split, epoch)

        main = torch.cuda.current_stream(self.device) if cuda else None
        with contextlib.closing(in_thread(decoded, depth=2, name=f"ddplab-decode-{split}")) as ahead:
            for x, y, ready in ahead:
                if main is not None:
                    main.wait_event(ready)  # here, not in the thread: steps queued before must not wait for it
                    x.record_stream(main)  # allocated on the side stream, used on this one
                    y.record_stream(main)
                yield x, y

    def _finish(self, batch, split: str, epoch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._prepare(batch, split, epoch)  # data.decode=cpu: the workers' uint8 crops

    def _on_side_stream(self, batch, split: str, epoch: int | None) -> tuple:
        """(x, y, the event after which they are ready on the device; None off CUDA)."""
        if self.stream is None:
            return *self._prepare(batch, split, epoch), None
        if self._done is not None:  # nvjpeg writes on its own stream, into memory this stream may still read
            self._done.synchronize()
        with torch.cuda.stream(self.stream):
            x, y = self._prepare(batch, split, epoch)
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
        return x, y, self._done

    def _prepare(self, batch, split: str, epoch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        skipped, ids, y = list(batch.skipped), batch.ids, batch.y
        if isinstance(batch, _Encoded):
            images = self._decode(batch, split)
            bad = [k for k, image in enumerate(images) if isinstance(image, ConfigError)]
            if bad and not self.skip:
                raise images[bad[0]]
            if bad:
                skipped += [str(images[k]) for k in bad]
                keep = [k for k in range(len(images)) if k not in set(bad)]
                images, ids, y = [images[k] for k in keep], ids[keep], y[keep]
                _check_some_left(images)
            x = self.crops(images, ids, epoch)
        else:
            x = batch.x.to(self.device, non_blocking=True)
        for line in skipped:
            self.skipped += 1
            log.warning("skipped: %s (data.skip_bad_images=true; %d skipped so far)", line, self.skipped)
        x = self.transform(x, self.draws(epoch, ids) if split == "train" else None)
        return x, y.to(self.device, non_blocking=True)

    def _decode(self, batch: _Encoded, split: str) -> list:
        """The batch's images on the device: JPEGs decoded there in one call, the rest (decoded by the worker)
        copied there."""
        bounds = batch.offsets.tolist()
        shapes = batch.shapes.tolist()
        parts = [batch.blob[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        jpegs = [k for k, shape in enumerate(shapes) if shape[0] == 0]
        images = [
            None if shape[0] == 0 else parts[k].view(shape).to(self.device, non_blocking=True)
            for k, shape in enumerate(shapes)
        ]
        files = self.files[split]
        decoded = decode_batch([parts[k] for k in jpegs], self.device, lambda j: files.name(int(batch.ids[jpegs[j]])))
        for k, image in zip(jpegs, decoded):
            images[k] = image
        return images

    def close(self) -> None:
        super().close()
        if self.skipped:
            log.warning("%d unreadable images were skipped (data.skip_bad_images=true)", self.skipped)
            self.skipped = 0


class _Failed(NamedTuple):
    error: BaseException


def in_thread(make_items, depth: int, name: str) -> Iterator:
    """What the generator `make_items()` yields, produced up to `depth` items ahead in a daemon thread. Its error
    is raised here; closing this generator (or leaving it early) stops the thread and waits for it."""
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop, end = threading.Event(), object()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for item in make_items():
                if not put(item):
                    return
            put(end)
        except BaseException as exc:  # handed to the consuming thread
            put(_Failed(exc))

    thread = threading.Thread(target=work, daemon=True, name=name)
    thread.start()
    try:
        while (item := out.get()) is not end:
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


def _one_line_errors(loader) -> Iterator:
    """A bad input found in a worker (e.g. an unreadable image) comes back wrapped in the worker's traceback;
    keep its own one line."""
    try:
        yield from loader
    except ConfigError as exc:
        last = str(exc).strip().splitlines()[-1]
        raise ConfigError(last.split("ConfigError: ", 1)[-1]) from None


def build_loader(data: DataBundle, cfg, device: torch.device, channels_last: bool, seed: int, compile: bool = False):
    """data.loader: gpu (device-resident), classic (DataLoader workers) or auto.
    compile (trainer.compile): compile the gpu loader's augmentation too."""
    choice = cfg.get("loader", "auto")
    pad_mode = cfg.get("pad_mode", "zeros")
    if choice == "auto":
        choice = "gpu" if data.in_memory and device.type == "cuda" else "classic"
    if choice == "gpu":
        if not data.in_memory:
            raise ConfigError(
                "data.loader=gpu needs a dataset that fits in memory; use data.loader=classic "
                "(data.decode=gpu decodes images read from disk on the GPU) or raise data.max_memory_gb"
            )
        return DeviceLoader(data, device, channels_last, seed, cfg.get("cutout", 0), compile, pad_mode)
    if isinstance(data.train.files, EncodedImages):
        decode = cfg.get("decode", "auto")
        on_device = decode == "gpu" or (decode == "auto" and device.type == "cuda")
        return DiskLoader(data, cfg, device, channels_last, seed, on_device)
    return ClassicLoader(data, device, channels_last, cfg.get("num_workers", 0), seed, cfg.get("cutout", 0), pad_mode)
