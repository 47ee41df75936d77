"""What the training process does with the workers' pieces (src/data/fetch.py): join a batch's pieces on its
device, crop images the workers left uncropped, crop and flip where the workers did not, and normalize. On a GPU
this runs on a CUDA stream of its own, while the step before still runs."""

from __future__ import annotations

import collections
import logging

import torch

from src.config.errors import ConfigError
from src.data.augment import Augmentation, EpochDraws, to_device
from src.data.datasets import DataBundle
from src.data.disk_crops import DiskCrops
from src.data.fetch import Fetched

log = logging.getLogger(__name__)


class DeviceFinish:
    """A batch's Fetched pieces -> (normalized float images, labels) on the training device. `crops` (images read
    from disk): this process crops what the workers shipped uncropped, and draws crop_flip's choices here; in-memory
    workers crop and flip themselves and ship their draws (for the cutout)."""

    def __init__(self, data: DataBundle, augmentation: Augmentation, seed: int, crops: DiskCrops | None = None):
        self.augmentation, self.device, self.crops = augmentation, augmentation.device, crops
        self.draws = None if crops is None else EpochDraws(augmentation, len(data.train), seed, self.device)
        self.skipped = 0
        self.held: collections.deque = collections.deque()  # workers' CUDA buffers still read by queued kernels
        # host batches are copied and normalized on a stream of their own, beside the step the GPU runs meanwhile
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.streamed = False

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
        return Fetched(x, torch.cat([piece.y for piece in pieces]), ids, skipped=skipped, shapes=shapes, flips=flips)

    def from_pieces(
        self, pieces: list[Fetched], split: str, epoch: int | None, order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """join, then finish. Pieces in host memory are copied and finished on a stream of their own, beside the
        step the GPU runs meanwhile; the training stream waits for the batch only where it reads it."""
        if self.stream is None or any(piece.x.is_cuda for piece in pieces):
            return self(self.join(pieces), split, epoch, order)
        training = torch.cuda.current_stream(self.device)
        if not self.streamed:  # what the training stream made before (the normalization's tables) is ready
            self.stream.wait_stream(training)
            self.streamed = True
        with torch.cuda.stream(self.stream):
            x, y = self(self.join(pieces), split, epoch, order)
        training.wait_stream(self.stream)
        x.record_stream(training)  # this stream must not reuse the memory while the step still reads it
        y.record_stream(training)
        return x, y

    def __call__(
        self, batch: Fetched, split: str, epoch: int | None, order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A joined batch -> the normalized float batch on the device, its images in the order of the sample ids
        `order` where given (data.decode=split joins the CPU pieces first)."""
        for line in batch.skipped:
            self.skipped += 1
            log.warning("skipped: %s (data.skip_bad_images=true; %d skipped so far)", line, self.skipped)
        x, ids, y = batch.x if batch.x.device == self.device else to_device(batch.x, self.device), batch.ids, batch.y
        if batch.shapes is not None:  # decoded, not yet cropped (or cut to the training crops' regions)
            parts = x.split(batch.shapes.prod(1).tolist())
            images, flips = [part.view(shape) for part, shape in zip(parts, batch.shapes.tolist())], batch.flips
            if order is not None:
                position, got = {i: k for k, i in enumerate(order.tolist())}, ids.tolist()
                ranked = sorted(range(len(got)), key=lambda j: position[got[j]])
                images, ids, y = [images[j] for j in ranked], ids[ranked], y[ranked]
                flips = None if flips is None else flips[ranked]
            cropped = self.crops(images, ids, epoch) if flips is None else self.crops.resize(images, flips.numpy())
            x, packed = cropped, x
            if batch.x.is_cuda:  # maybe a worker's memory (CUDA IPC), read by the queued crops
                self._hold(packed)
        if self.draws is None:  # the workers cropped and flipped (or the data has no crop_flip)
            params = None if batch.params is None else batch.params.to(self.device, non_blocking=True)
            x = self.augmentation.finish(x, params)
        else:
            x = self.augmentation(x, self.draws(epoch, ids) if split == "train" else None)
        return x, to_device(y, self.device)

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
