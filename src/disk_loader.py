"""Batches of images read from disk (an ImageFolder too big for memory, packed shards): DataLoader workers
read the files; the device decodes them (data.decode=gpu: nvjpeg, in a second thread, on a side stream) or the
workers do (data.decode=cpu). Either way uint8 reaches the device, which normalizes."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import torch

from src.augment import DiskCrops, to_device
from src.config import ConfigError
from src.datasets import DataBundle, Split
from src.decode import EncodedImages, as_tensor, decode_batch, decode_cpu, gpu_decodable
from src.loaders import ClassicLoader, MicroBatch, Step, _Batch, _EpochDraws, _one_line_errors, _Requests, _Transform

log = logging.getLogger(__name__)


class _Encoded(NamedTuple):
    """A worker's batch for the device to decode: images back to back in `blob` (offsets: B + 1), each an
    encoded JPEG (shape row 0, 0, 0) or, where the device decoder cannot take it, uint8 pixels of that shape."""

    blob: torch.Tensor
    offsets: torch.Tensor
    shapes: torch.Tensor
    y: torch.Tensor
    ids: torch.Tensor
    skipped: tuple[str, ...] = ()


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
        # high priority: the crops are hundreds of small kernels in a row, each of which can wait for the model's
        # large kernels to leave room on the SMs (at normal priority, decoding did not overlap the step on an H100)
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

    def _on_side_stream(self, batch, split: str, epoch: int | None) -> tuple:
        """(x, y, the event after which they are ready on the device; None off CUDA)."""
        if self.stream is None:
            return *self._finish(batch, split, epoch), None
        if self._done is not None:  # nvjpeg writes on its own stream, into memory this stream may still read
            self._done.synchronize()
        with torch.cuda.stream(self.stream):
            x, y = self._finish(batch, split, epoch)
            self._done = torch.cuda.Event()
            self._done.record(self.stream)
        return x, y, self._done

    def _finish(self, batch, split: str, epoch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A worker's batch -> the normalized float batch on the device (decoded here when it comes encoded)."""
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
            x = to_device(batch.x, self.device)
        for line in skipped:
            self.skipped += 1
            log.warning("skipped: %s (data.skip_bad_images=true; %d skipped so far)", line, self.skipped)
        x = self.transform(x, self.draws(epoch, ids) if split == "train" else None)
        return x, to_device(y, self.device)

    def _decode(self, batch: _Encoded, split: str) -> list:
        """The batch's images on the device: JPEGs decoded there in one call, the rest (decoded by the worker)
        copied there."""
        bounds = batch.offsets.tolist()
        shapes = batch.shapes.tolist()
        parts = [batch.blob[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        jpegs = [k for k, shape in enumerate(shapes) if shape[0] == 0]
        images = [
            None if shape[0] == 0 else to_device(parts[k].view(shape), self.device)
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
