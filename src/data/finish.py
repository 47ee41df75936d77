"""What the training process does with the workers' pieces (src/data/fetch.py): join a batch's pieces on its
device, crop images the workers left uncropped, crop and flip where the workers did not, and normalize."""

from __future__ import annotations

import collections
import logging
import math

import torch

from src.config.errors import ConfigError
from src.data.augment import Augmentation, DiskCrops, EpochDraws, to_device
from src.data.datasets import DataBundle
from src.data.decode import NvImageCodec, decode_cpu
from src.data.fetch import Fetched

log = logging.getLogger(__name__)


class DeviceFinish:
    """A batch's Fetched pieces -> (normalized float images, labels) on the training device. `crops` (images read
    from disk): this process crops what the workers shipped uncropped, and draws crop_flip's choices here; in-memory
    workers crop and flip themselves and ship their draws (for the cutout)."""

    def __init__(
        self, data: DataBundle, augmentation: Augmentation, seed: int, crops: DiskCrops | None = None, skip=False
    ):
        self.data, self.augmentation, self.device, self.crops = data, augmentation, augmentation.device, crops
        self.draws = None if crops is None else EpochDraws(augmentation, len(data.train), seed, self.device)
        self.skip, self.skipped = skip, 0
        self.held: collections.deque = collections.deque()  # workers' CUDA buffers still read by queued kernels
        self.codec: NvImageCodec | None = None  # data.decode=nvimgcodec, made with the first batch of JPEGs
        self.decoding: torch.cuda.Stream | None = None  # its stream, beside the step's
        self.decoded_read: torch.cuda.Event | None = None  # recorded once the last decoded batch is resized

    def join(self, pieces: list[Fetched]) -> Fetched:
        """One batch from the pieces of several workers, joined on the device: each pinned piece is copied there
        once, with no host copy in between."""
        skipped = tuple(line for piece in pieces for line in piece.skipped)
        pieces = [piece for piece in pieces if len(piece.ids)]
        if not pieces:  # possible only with data.skip_bad_images
            raise ConfigError("every image of a batch was unreadable (data.skip_bad_images=true); check the data")
        if len(pieces) == 1:
            return pieces[0]._replace(skipped=skipped)
        shapes = None if pieces[0].shapes is None else torch.cat([piece.shapes for piece in pieces])
        flips = None if pieces[0].flips is None else torch.cat([piece.flips for piece in pieces])
        x = torch.cat([to_device(piece.x, self.device) for piece in pieces])
        for piece in pieces:
            if piece.x.is_cuda:  # a GPU-decoding worker's memory, read by the queued copy (data.decode=split)
                self._hold(piece.x)
        ids = torch.cat([piece.ids for piece in pieces])
        encoded = {}
        if pieces[0].encoded is not None:  # data.decode=nvimgcodec: bytes stay on the host, for nvImageCodec
            encoded = {k: torch.cat([getattr(piece, k) for piece in pieces]) for k in ("encoded", "lengths")}
            encoded["boxes"] = None if pieces[0].boxes is None else torch.cat([piece.boxes for piece in pieces])
        y = torch.cat([piece.y for piece in pieces])
        return Fetched(x, y, ids, skipped=skipped, shapes=shapes, flips=flips, **encoded)

    def __call__(
        self, batch: Fetched, split: str, epoch: int | None, order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A joined batch -> the normalized float batch on the device, its images in the order of the sample ids
        `order` where given (data.decode=split joins the CPU pieces first)."""
        for line in batch.skipped:
            self._skip(line)
        x, ids, y = batch.x if batch.x.device == self.device else to_device(batch.x, self.device), batch.ids, batch.y
        if batch.shapes is not None:  # decoded, not yet cropped (or cut to the training crops' regions)
            flips = batch.flips
            if batch.encoded is None:
                parts = x.split(batch.shapes.prod(1).tolist())
                images = [part.view(shape) for part, shape in zip(parts, batch.shapes.tolist())]
            else:
                images, keep = self._decoded(batch, x, split)
                if keep is not None:  # data.skip_bad_images: a JPEG that no decoder reads
                    ids, y, flips = ids[keep], y[keep], None if flips is None else flips[keep]
            if order is not None:
                position, got = {i: k for k, i in enumerate(order.tolist())}, ids.tolist()
                ranked = sorted(range(len(got)), key=lambda j: position[got[j]])
                images, ids, y = [images[j] for j in ranked], ids[ranked], y[ranked]
                flips = None if flips is None else flips[ranked]
            cropped = self.crops(images, ids, epoch) if flips is None else self.crops.resize(images, flips.numpy())
            x, packed = cropped, x
            if batch.x.is_cuda:  # maybe a worker's memory (CUDA IPC), read by the queued crops
                self._hold(packed)
            if batch.encoded is not None and self.decoding is not None:  # the next batch's decoding waits for this
                self.decoded_read = torch.cuda.Event()
                self.decoded_read.record()
                self._hold(images)
        if self.draws is None:  # the workers cropped and flipped (or the data has no crop_flip)
            params = None if batch.params is None else batch.params.to(self.device, non_blocking=True)
            x = self.augmentation.finish(x, params)
        else:
            x = self.augmentation(x, self.draws(epoch, ids) if split == "train" else None)
        return x, to_device(y, self.device)

    def _decoded(self, batch: Fetched, x: torch.Tensor, split: str) -> tuple[list, list | None]:
        """data.decode=nvimgcodec: (each image on the device, in the batch's order; the positions kept, or None
        where all are). The JPEGs are decoded here, their regions only, on a stream of their own that the step's
        stream then waits for: in this process's CUDA context, beside the step, not time-sliced against it as a
        worker's context is. The other images came decoded in x. A JPEG no backend decodes is decoded on the CPU,
        which names what is wrong."""
        if self.codec is None:
            self.codec = NvImageCodec(self.device)
            self.decoding = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        lengths, shapes = batch.lengths.tolist(), batch.shapes.tolist()
        jpegs = [k for k, n in enumerate(lengths) if n]
        blobs = batch.encoded.split([lengths[k] for k in jpegs])
        boxes = None if batch.boxes is None else batch.boxes[jpegs].tolist()
        if self.decoding is None:
            decoded = self.codec(blobs, boxes)
        else:
            if self.decoded_read is not None:  # the reused buffers are free once the last batch is resized
                self.decoding.wait_event(self.decoded_read)
            with torch.cuda.stream(self.decoding):
                decoded = self.codec(blobs, boxes, self.decoding.cuda_stream)
            torch.cuda.current_stream(self.device).wait_stream(self.decoding)
        pixels = iter(x.split([math.prod(shape) for k, shape in enumerate(shapes) if not lengths[k]]))
        by_position = dict(zip(jpegs, zip(decoded, blobs)))
        images, keep = [], []
        for k, shape in enumerate(shapes):
            if k not in by_position:
                images.append(next(pixels).view(shape))
            elif by_position[k][0] is not None:
                images.append(by_position[k][0])
            else:
                files = getattr(self.data, split).files
                try:
                    image = decode_cpu(by_position[k][1], files.name(int(batch.ids[k])))
                except ConfigError as exc:
                    if not self.skip:
                        raise
                    self._skip(str(exc))
                    continue
                top, left, h, w = batch.boxes[k].tolist() if batch.boxes is not None else (0, 0, *shape[1:])
                images.append(to_device(image[:, top : top + h, left : left + w].contiguous(), self.device))
            keep.append(k)
        if not images:
            raise ConfigError("every image of a batch was unreadable (data.skip_bad_images=true); check the data")
        return images, None if len(keep) == len(shapes) else keep

    def _skip(self, line: str) -> None:
        self.skipped += 1
        log.warning("skipped: %s (data.skip_bad_images=true; %d skipped so far)", line, self.skipped)

    def _hold(self, packed: torch.Tensor) -> None:
        """Keep a worker's buffer until the kernels queued on it are done: once this process lets it go, the
        worker may write the next batch into it (CUDA IPC memory), and the crops run asynchronously."""
        done = torch.cuda.Event()
        done.record()
        self.held.append((packed, done))
        while self.held and (len(self.held) > 8 or self.held[0][1].query()):
            self.held.popleft()[1].synchronize()

    def close(self) -> None:
        """Release the workers' buffers (before the workers that own the memory stop); say what was skipped."""
        for _, done in self.held:
            done.synchronize()
        self.held.clear()
        if self.skipped:
            log.warning("%d unreadable images were skipped (data.skip_bad_images=true)", self.skipped)
            self.skipped = 0
