"""Batches of images read from disk (an ImageFolder too big for memory, packed shards), made by DataLoader
workers that read their batch's files and decode them: on the GPU (data.decode=gpu: nvjpeg, each worker in a CUDA
context of its own; the training process crops them) or on their CPUs (data.decode=cpu: the workers crop too, or
with data.crop=device the training process does). Either way uint8 reaches the training process, which normalizes
on its device. data.decode=split shares each batch between both: CPU workers decode most of it, and a few
GPU-decoding workers the share data.gpu_share, for hosts whose CPUs cannot feed their GPUs alone."""

from __future__ import annotations

import collections
import logging

import torch

from src.config.errors import ConfigError
from src.data.augment import DiskCrops, to_device, trivial_augment
from src.data.datasets import DataBundle, Split
from src.data.decode import EncodedImages, as_tensor, decode_batch, decode_cpu, gpu_decodable
from src.data.loaders import (
    AUTO_GPU_DECODING_WORKERS,
    ClassicLoader,
    Recipe,
    _Batch,
    _EpochDraws,
    _Requests,
    _Transform,
)

log = logging.getLogger(__name__)


# Images per worker fetch at least. A batch is spread over the workers, so that the first batch of a pass is ready
# after one piece, not after one worker has decoded a whole batch (256 ResNet-50 images: ~0.5 s of an idle GPU per
# pass on an H100 host). The floor keeps a batch's fetches few: each is a queue hop and a pinned copy here.
MIN_PIECE = 32


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


class _DiskBatches(torch.utils.data.Dataset):
    """Worker side, a piece of a batch of any split per fetch: (split, epoch, ids) -> uint8 images and labels.
    device None (data.decode=cpu): decoded by this worker's CPU and cropped here. Else decoded on `device`: the
    JPEGs its decoder takes in one batched call (nvjpeg on CUDA), the rest (PNG, CMYK, grayscale, progressive) on
    the CPU; shipped uncropped, back to back in one buffer, for the training process to crop. On CUDA each worker
    has a CUDA context of its own: nvjpeg waits on the host for each image's colour conversion, which behind the
    step's kernels in one context took ~1 ms an image (H100: 670 images/s instead of 17,000); from another
    process it keeps its speed and the step keeps its own. Cropping in the workers too slowed both the workers
    and the step (H100: 3,071 and 3,154 images/s beside each other), so the training process crops."""

    def __init__(
        self,
        splits: dict[str, Split],
        crops: DiskCrops,
        device: torch.device | None,
        skip: bool,
        crop_here: bool,
        trivial: bool = False,
    ):
        self.splits, self.crops, self.device, self.skip, self.trivial = splits, crops, device, skip, trivial
        self.crop_here = crop_here  # false: whole images go to the training process, which crops them

    def __len__(self):
        return len(self.splits["train"])

    def __getitems__(self, request):
        split, epoch, ids = request[0], request[1], torch.from_numpy(request[2])
        files, labels = self.splits[split].files, self.splits[split].labels
        if self.device is None:
            kept, images, skipped = _read_or_skip(
                files, ids, self.skip, lambda data, i: decode_cpu(as_tensor(data), files.name(i))
            )
        else:
            kept, images, skipped = self._decode_on_device(files, ids)
        ids = ids[kept]
        if not images:  # every image skipped (data.skip_bad_images): the training process checks the whole batch
            return _Batch(torch.empty(0, dtype=torch.uint8), labels[ids], ids=ids, skipped=tuple(skipped))
        if self.crop_here:
            x = self.crops(images, ids, epoch)
            if self.trivial and split == "train" and epoch is not None:
                x = trivial_augment(x, self.crops.seed, epoch, ids)
            return _Batch(x, labels[ids], ids=ids, skipped=tuple(skipped))
        # a training crop's region only, not the whole image: about the crop's bytes cross to the training process
        cut = self.crops.regions(images, ids, epoch)
        images, flips = cut if cut else (images, None)
        packed = torch.cat([image.reshape(-1) for image in images])  # not yet resized, back to back
        if packed.is_cuda:  # the training process reads it as soon as it arrives
            torch.cuda.current_stream(packed.device).synchronize()
        shapes = torch.tensor([tuple(image.shape) for image in images])
        flips = None if flips is None else torch.from_numpy(flips)
        return _Batch(packed, labels[ids], ids=ids, skipped=tuple(skipped), shapes=shapes, flips=flips)

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


class DiskLoader(ClassicLoader):
    """Images read from disk (an ImageFolder too big for memory, packed shards) by DataLoader workers, one set
    of workers for every split. data.decode=gpu: the workers decode on the GPU, each in a CUDA context of its own
    (started with "spawn"; 3 decode ~11,000 images/s on an H100), and this process crops the batch there (a few
    batched kernels); cpu: the workers decode and crop on their CPUs (the "classic" path), or decode and cut each
    training crop's region, and this process resizes them on its device (data.crop=device: "cpudecode").
    `crop_on_device` is true whenever this process crops (always with GPU decoding). Either way uint8 reaches the
    device, which normalizes."""

    from_disk = True
    one_loader_for_all_splits = True

    def __init__(
        self,
        data: DataBundle,
        cfg,
        device: torch.device,
        channels_last: bool,
        seed: int,
        on_device: bool,
        crop_on_device: bool,
        num_workers: int,
        gpu_share: float = 0.0,
    ):
        if device.type == "cuda" and device.index is None:  # the workers must know which GPU "cuda" means here
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.on_device, self.num_workers, self.seed = device, on_device, num_workers, seed
        self.gpu_share = gpu_share  # data.decode=split: CPU workers decode and this process crops (crop_on_device)
        self.name = "split" if gpu_share else "gpudecode" if on_device else "cpudecode" if crop_on_device else "classic"
        self.skip = bool(cfg.get("skip_bad_images", False))
        self.crops = crops = DiskCrops(
            data.image_size,
            data.augment == "random_resized_crop",
            seed,
            cfg.get("rrc_scale", (0.08, 1.0)),
            cfg.get("rrc_ratio", (3 / 4, 4 / 3)),
        )
        recipe = Recipe.of(cfg)
        if recipe.trivial and crop_on_device:  # check_data_config refuses what asks for it; this is the backstop
            raise ConfigError("data.auto_augment=trivial runs in CPU workers: set data.decode=cpu data.crop=workers")
        cutout, pad_mode = cfg.get("cutout", 0), cfg.get("pad_mode", "zeros")
        self.transform = _Transform(data, channels_last, device, cutout, pad_mode, recipe)
        self.draws = _EpochDraws(self.transform, len(data.train), seed, device)
        splits = {k: getattr(data, k) for k in ("train", "val", "test")}
        self.dataset = _DiskBatches(
            splits, crops, device if on_device else None, self.skip, not crop_on_device, recipe.trivial
        )
        gpu_decoding = on_device and device.type == "cuda"
        self.cuda_workers = gpu_decoding and self.num_workers > 0
        if gpu_share:  # a second set of workers, decoding each batch's GPU share on the device
            self.gpu_dataset = _DiskBatches(splits, crops, device, self.skip, crop_here=False)
            self.gpu_requests = _Requests()
            self.gpu_workers = AUTO_GPU_DECODING_WORKERS
            self.cuda_gpu_workers = device.type == "cuda"
        if gpu_decoding and not self.num_workers:
            log.warning(
                "data.decode=gpu with data.num_workers=0 decodes in the training process, where nvjpeg waits "
                "behind the step's kernels (~25x slower on an H100); set data.num_workers=3"
            )
        self.pin = device.type == "cuda" and not on_device  # the device path's batches arrive on the device
        self.requests = _Requests()
        self.loaders = {}
        self.ahead = None  # what prepare() sent the workers before the trainer asks for it
        self.skipped = 0
        self.held: collections.deque = collections.deque()  # workers' CUDA buffers still read by queued kernels

    def _loader(self, split: str, requests: list, on_gpu: bool = False) -> torch.utils.data.DataLoader:
        """One DataLoader for every split, its workers kept alive between passes (persistent_workers); with
        data.decode=split (on_gpu) a second one, of GPU-decoding workers."""
        key, sampler = ("gpu", self.gpu_requests) if on_gpu else ("all", self.requests)
        sampler.items = requests
        if key not in self.loaders:  # CUDA cannot start in a forked child
            if on_gpu:
                start = "spawn" if self.cuda_gpu_workers else "fork"
                # their batches are already on the GPU: nothing to pin
                self.loaders[key] = self._data_loader(self.gpu_dataset, sampler, start, self.gpu_workers, pin=False)
            else:
                self.loaders[key] = self._data_loader(self.dataset, sampler, "spawn" if self.cuda_workers else "fork")
        return self.loaders[key]

    def _request(self, split: str, epoch: int | None, piece: torch.Tensor) -> tuple:
        """One set of workers serves every split: each piece says its own."""
        return split, *super()._request(split, epoch, piece)

    def prepare(self, steps, epoch: int, evals=()) -> None:
        """ClassicLoader's, but not with data.decode=split, whose batches come from two sets of workers."""
        if not self.gpu_share:
            super().prepare(steps, epoch, evals)

    def _batches(self, split: str, epoch: int | None, batches: list[torch.Tensor]):
        """data.decode=split: each batch's GPU share (gpu_decoded) fetched from the GPU-decoding workers, the rest
        in pieces from the CPU workers, and joined again in the batch's order. Otherwise ClassicLoader's."""
        if not self.gpu_share:
            yield from super()._batches(split, epoch, batches)
            return
        on_gpu = [gpu_decoded(ids, self.gpu_share) for ids in batches]
        gpu_parts = [ids[mask] for ids, mask in zip(batches, on_gpu)]
        cpu_parts = [ids[~mask] for ids, mask in zip(batches, on_gpu)]
        cpu_pieces = [part.split(self._piece_size(len(part))) if len(part) else () for part in cpu_parts]
        from_cpu = self._fetch(split, epoch, [piece for pieces in cpu_pieces for piece in pieces])
        from_gpu = self._fetch(split, epoch, [part for part in gpu_parts if len(part)], on_gpu=True)
        for ids, pieces, part in zip(batches, cpu_pieces, gpu_parts):
            fetched = [next(from_cpu) for _ in pieces] + ([next(from_gpu)] if len(part) else [])
            yield self._finish(self._join(fetched), split, epoch, order=ids)

    def _piece_size(self, n: int) -> int:
        """CPU decoding: a batch spread over the workers, MIN_PIECE images or more each. GPU decoding keeps whole
        batches: its few workers decode a batch in one call, fast enough that the first one is soon ready."""
        if self.on_device or self.num_workers < 2:
            return n
        return max(MIN_PIECE, -(-n // self.num_workers))

    def _join(self, pieces: list[_Batch]) -> _Batch:
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
        return _Batch(
            x,
            torch.cat([piece.y for piece in pieces]),
            ids=torch.cat([piece.ids for piece in pieces]),
            skipped=skipped,
            shapes=shapes,
            flips=flips,
        )

    def _finish(
        self, batch: _Batch, split: str, epoch: int | None, order: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A worker's uint8 batch -> the normalized float batch on the device, its images in the order of the
        sample ids `order` where given (data.decode=split joins the CPU pieces first)."""
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
        x = self.transform(x, self.draws(epoch, ids) if split == "train" else None)
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
        for _, done in self.held:  # released before the workers that own the memory stop
            done.synchronize()
        self.held.clear()
        super().close()
        if self.skipped:
            log.warning("%d unreadable images were skipped (data.skip_bad_images=true)", self.skipped)
            self.skipped = 0
