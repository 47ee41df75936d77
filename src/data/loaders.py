"""Batches for one rank, as the LoaderPlan says (src/data/loader_plan.py): `ResidentLoader` keeps the dataset in
device memory and augments it there; `WorkerLoader` has DataLoader workers fetch each batch (src/data/fetch.py)
and finishes it on the device (src/data/finish.py), sending the next epoch to the workers ahead of the trainer
(src/data/epoch.py); `DaliLoader` has DALI decode and crop each batch in this process (src/data/dali.py). All
take each micro-batch's samples from the epoch plan and draw every random choice from (seed, epoch, sample id), so
all loaders, strategies and world sizes give the same batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from src.data.augment import Augmentation, AugmentOptions, to_device
from src.data.dali import DaliCrops
from src.data.datasets import DataBundle, options_of
from src.data.decode import EncodedImages
from src.data.disk_crops import DiskCrops
from src.data.epoch import MicroBatch, ReadAhead, Step, micro_batches, with_boundaries
from src.data.fetch import (
    DiskFetch,
    Fetched,
    FileFetch,
    MemoryFetch,
    Requests,
    fetching,
    gpu_decoded,
    worker_loader,
)
from src.data.finish import DeviceFinish
from src.data.loader_plan import LoaderOptions, LoaderPlan, resolve_plan

# Images per worker fetch at least, when CPU workers decode. A batch is spread over the workers, so that the first
# batch of a pass is ready after one piece, not after one worker has decoded a whole batch; the floor keeps a
# batch's fetches few: each is a queue hop and a pinned copy.
MIN_PIECE = 32


class ResidentLoader:
    """The whole dataset lives on the device as uint8; augmentation runs there, batched."""

    plan = LoaderPlan(resident=True)

    def __init__(self, data: DataBundle, augmentation: Augmentation, seed: int, compile: bool = False):
        self.augmentation, self.device, self.seed = augmentation, augmentation.device, seed
        self.splits = {
            k: (getattr(data, k).images.to(self.device), getattr(data, k).labels.to(self.device))
            for k in ("train", "val", "test")
        }
        # compiled: gather, crop, flip, normalize, cutout and layout become two kernels instead of ~15
        self._train_batch = torch.compile(self._augmented, dynamic=False) if compile else self._augmented
        self._ready = None  # (epoch, number of steps, augmentation draws, sample ids, recipe draws) prepared ahead

    def _augmented(self, images, labels, params, ids, recipe):
        return self.augmentation.apply_recipe(self.augmentation(images[ids], params[ids]), labels[ids], recipe)

    def prepare(self, steps: list[Step], epoch: int, evals: Sequence = ()) -> None:
        """Draw an epoch's augmentation and copy its sample ids to the device now. The trainer calls this
        for the next epoch once this epoch's last step is queued, so the host work overlaps the device's."""
        aug = self.augmentation
        params = aug.draw(len(self.splits["train"][1]), self.seed, epoch).to(self.device)
        # one host-to-device copy per epoch: per-batch copies of pageable memory would stall the host
        ids = torch.cat(micro_batches(steps)).to(self.device) if steps else None
        recipe = None
        if steps and aug.recipe.on:  # drawn per micro-batch (its pairs), copied once
            recipe = torch.cat([aug.recipe_draws(self.seed, epoch, ids) for ids in micro_batches(steps)])
            recipe = recipe.to(self.device)
        self._ready = (epoch, len(steps), params, ids, recipe)

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        images, labels = self.splits["train"]
        if not (self._ready and self._ready[:2] == (epoch, len(steps))):  # (a resumed epoch has fewer steps)
            self.prepare(steps, epoch)
        _, _, params, all_ids, all_recipe = self._ready
        self._ready = None
        offset = 0
        for ids, boundary, count in with_boundaries(steps):
            part = slice(offset, offset + len(ids))
            offset += len(ids)
            recipe = None if all_recipe is None else all_recipe[part]
            x, y, mix = self._train_batch(images, labels, params, all_ids[part], recipe)
            yield MicroBatch(x, y, boundary, count, mix)

    def close(self) -> None:
        self.splits = {}

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        images, labels = self.splits[split]
        for chunk in ids.to(self.device).split(batch_size):
            yield self.augmentation(images[chunk], None), labels[chunk]


class WorkerLoader:
    """torch DataLoader workers with pinned memory and prefetching fetch each batch; this process finishes it.
    In-memory data has workers per split; images read from disk one set for every split (and with
    data.decode=split a second set, decoding each batch's GPU share)."""

    def __init__(
        self,
        data: DataBundle,
        plan: LoaderPlan,
        augmentation: Augmentation,
        seed: int,
        crops: DiskCrops | None = None,
        skip_bad_images: bool = False,
    ):
        self.plan, self.augmentation, self.device, self.seed = plan, augmentation, augmentation.device, seed
        self.finish = DeviceFinish(data, augmentation, seed, crops)
        cuda, gpu_decoding = self.device.type == "cuda", plan.decode == "gpu"
        if plan.decode:
            on_gpu = self.device if gpu_decoding else None
            trivial = augmentation.recipe.trivial
            self.fetch = DiskFetch(data, crops, on_gpu, skip_bad_images, trivial)
        elif data.in_memory:
            self.fetch = MemoryFetch(data, augmentation.for_workers(data), seed)
        else:
            self.fetch = FileFetch(data)
        if plan.gpu_share:  # a second set of workers, decoding each batch's GPU share on the device
            self.gpu_fetch = DiskFetch(data, crops, self.device, skip_bad_images)
        self.pin = cuda and not gpu_decoding  # GPU-decoded batches arrive on the device
        self.cuda_workers = gpu_decoding and cuda and plan.workers > 0  # CUDA cannot start in a forked child
        self.cuda_gpu_workers = cuda
        self.requests: dict[str, Requests] = {}
        self.loaders: dict[str, torch.utils.data.DataLoader] = {}
        self.ahead: ReadAhead | None = None  # what prepare() sent the workers before the trainer asks for it

    def settle_crops(self, on_device: bool) -> None:
        """data.crop=auto's measured choice: the batches asked for from now on are cropped by this process
        (`on_device`) or by the workers; the same crops either way (src/data/disk_crops.py)."""
        self.plan = self.plan.settled(on_device)

    def _request(self, split: str, epoch: int | None, ids: torch.Tensor) -> tuple:
        """A worker's request: (split, epoch, sample ids as numpy) and, for images read from disk, whether the
        worker crops."""
        return (split, epoch, ids.numpy(), not self.plan.crop_on_device)

    def _key(self, split: str) -> str:
        """Which DataLoader serves `split`: its own for in-memory data, one for all splits of images from disk."""
        return "all" if self.plan.decode else split

    def _loader(self, key: str, requests: list) -> torch.utils.data.DataLoader:
        """The DataLoader `key` names ("gpu": data.decode=split's GPU-decoding workers), refilled with
        `requests`; its workers are kept alive between passes (persistent_workers)."""
        self.requests.setdefault(key, Requests()).items = requests
        if key not in self.loaders:
            if key == "gpu":  # their batches are already on the GPU: nothing to pin
                fetch, workers, pin, spawn = self.gpu_fetch, self.plan.gpu_workers, False, self.cuda_gpu_workers
            else:
                fetch, workers, pin, spawn = self.fetch, self.plan.workers, self.pin, self.cuda_workers
            self.loaders[key] = worker_loader(fetch, self.requests[key], workers, pin, spawn)
        return self.loaders[key]

    def _fetch(self, key: str, split: str, epoch: int | None, pieces: list[torch.Tensor]) -> Iterator[Fetched]:
        """What the workers of DataLoader `key` make of each piece of sample ids, in order."""
        return fetching(self._loader(key, [self._request(split, epoch, piece) for piece in pieces]))

    def _pieces(self, batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
        """Each batch of sample ids cut into the pieces one worker makes: CPU decoding spreads a batch over the
        workers, MIN_PIECE images or more each; otherwise a worker makes a whole batch (GPU decoding's few
        workers decode one in a single call)."""
        spread = self.plan.decode in ("cpu", "split") and self.plan.workers >= 2
        size = (lambda n: max(MIN_PIECE, -(-n // self.plan.workers))) if spread else (lambda n: max(1, n))
        return [ids.split(size(len(ids))) for ids in batches]

    def prepare(self, steps: list[Step], epoch: int, evals: Sequence[tuple[str, torch.Tensor, int]] = ()) -> None:
        """Send the workers now what the trainer takes next: the evaluations `evals` (split, sample ids, batch
        size) where the training's workers make them too, then the epoch `steps`. The trainer calls this once an
        epoch's last step is queued, so the next epoch starts with batches made. Not with data.decode=split, whose
        batches come from two sets of workers."""
        if not self.plan.workers or self.plan.gpu_share:
            return
        key = self._key("train")
        segments = [(s, None, list(ids.split(size))) for s, ids, size in evals if self._key(s) == key]
        segments.append(("train", epoch, micro_batches(steps)))
        requests = [
            self._request(split, when, piece)
            for split, when, batches in segments
            for pieces in self._pieces(batches)
            for piece in pieces
        ]
        self.ahead = ReadAhead(key, segments, fetching(self._loader(key, requests)))

    def _batches(self, split: str, epoch: int | None, batches: list[torch.Tensor]) -> Iterator[tuple]:
        """The finished (x, y) of each batch of sample ids, fetched in pieces and joined again: from the pass
        `prepare` started where it holds them next."""
        if self.plan.gpu_share:
            yield from self._shared_batches(split, epoch, batches)
            return
        pieces, key = self._pieces(batches), self._key(split)
        fetched = self.ahead.take(split, epoch, batches, sum(map(len, pieces))) if self.ahead else None
        if fetched is None:
            if self.ahead and self.ahead.loader_key == key:
                self.ahead = None  # the new pass below replaces it on the same workers
            fetched = self._fetch(key, split, epoch, [piece for batch in pieces for piece in batch])
        cropped_on_device = self.plan.crop_on_device
        for k, batch in enumerate(pieces):
            if self.plan.crop_on_device != cropped_on_device:  # settled during the pass: the rest asked anew
                cropped_on_device, self.ahead = self.plan.crop_on_device, None
                fetched = self._fetch(key, split, epoch, [piece for later in pieces[k:] for piece in later])
            yield self.finish.from_pieces([next(fetched) for _ in batch], split, epoch)

    def _shared_batches(self, split: str, epoch: int | None, batches: list[torch.Tensor]) -> Iterator[tuple]:
        """data.decode=split: each batch's GPU share (gpu_decoded) fetched from the GPU-decoding workers, the rest
        in pieces from the CPU workers, and joined again in the batch's order."""
        on_gpu = [gpu_decoded(ids, self.plan.gpu_share) for ids in batches]
        gpu_parts = [ids[mask] for ids, mask in zip(batches, on_gpu)]
        cpu_pieces = [self._pieces([part])[0] if len(part) else () for part in (i[~m] for i, m in zip(batches, on_gpu))]
        from_cpu = self._fetch("all", split, epoch, [piece for pieces in cpu_pieces for piece in pieces])
        from_gpu = self._fetch("gpu", split, epoch, [part for part in gpu_parts if len(part)])
        for ids, pieces, part in zip(batches, cpu_pieces, gpu_parts):
            fetched = [next(from_cpu) for _ in pieces] + ([next(from_gpu)] if len(part) else [])
            yield self.finish.from_pieces(fetched, split, epoch, order=ids)

    def train_batches(self, steps: list[Step], epoch: int) -> Iterator[MicroBatch]:
        batches, aug = self._batches("train", epoch, micro_batches(steps)), self.augmentation
        for ids, boundary, count in with_boundaries(steps):
            x, y = next(batches)
            draws = to_device(aug.recipe_draws(self.seed, epoch, ids), self.device) if aug.recipe.on else None
            x, y, mix = aug.apply_recipe(x, y, draws)
            yield MicroBatch(x, y, boundary, count, mix)

    def eval_batches(self, split: str, ids: torch.Tensor, batch_size: int) -> Iterator[tuple]:
        yield from self._batches(split, None, list(ids.split(batch_size)))

    def close(self) -> None:
        """Stop the persistent workers now, not at interpreter exit (seen: a run with CUDA graphs whose
        process did not exit while they were alive)."""
        self.finish.close()
        for loader in self.loaders.values():
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()
        self.loaders.clear()
        self.ahead = None


class DaliLoader:
    """data.decode=dali: a DALI pipeline in this process decodes and crops each batch (src/data/dali.py), with the
    crops and flips ddplab draws; this process finishes it as it does the workers' (normalize, cutout, recipe)."""

    def __init__(self, data: DataBundle, plan: LoaderPlan, augmentation: Augmentation, seed: int, crops: DiskCrops):
        self.plan, self.augmentation, self.device, self.seed = plan, augmentation, augmentation.device, seed
        self.finish = DeviceFinish(data, augmentation, seed, crops)
        self.dali = DaliCrops(data, crops, self.device, plan.workers)

    def prepare(self, steps: list[Step], epoch: int, evals: Sequence = ()) -> None:
        """Nothing ahead of the pass: DALI starts on a pass's first batches as the trainer asks for it."""

    def _batches(self, split: str, epoch: int | None, batches: list[torch.Tensor]) -> Iterator[tuple]:
        for fetched in self.dali(split, epoch, batches):
            yield self.finish(fetched, split, epoch)

    # a pass is made of batches as the workers' is, with the recipe on top: their code, on this _batches
    train_batches = WorkerLoader.train_batches
    eval_batches = WorkerLoader.eval_batches

    def close(self) -> None:
        self.dali.close()
        self.finish.close()


def build_loader(
    data: DataBundle,
    cfg,
    device: torch.device,
    channels_last: bool,
    seed: int,
    compile: bool = False,
    local_processes: int = 1,
) -> ResidentLoader | WorkerLoader | DaliLoader:
    """The loader of the data config `cfg` (its options: LoaderOptions, AugmentOptions). compile
    (trainer.compile): compile the resident loader's augmentation too. local_processes: the training processes
    of this node (data.num_workers=auto shares its CPUs among them)."""
    options, augment = (options_of(cfg, spec) for spec in (LoaderOptions, AugmentOptions))
    plan = resolve_plan(
        options, device, data.in_memory, isinstance(data.train.files, EncodedImages), augment.trivial, local_processes
    )
    if device.type == "cuda" and device.index is None:  # the workers must know which GPU "cuda" means here
        device = torch.device("cuda", torch.cuda.current_device())
    recipe = augment.recipe
    augmentation = Augmentation(data, channels_last, device, augment.cutout, augment.pad_mode, recipe, augment.flip)
    if plan.resident:
        return ResidentLoader(data, augmentation, seed, compile)
    crops = None
    if plan.decode:
        rrc = data.augment == "random_resized_crop"
        crops = DiskCrops(data.image_size, rrc, seed, augment.rrc_scale, augment.rrc_ratio)
    if plan.decode == "dali":
        return DaliLoader(data, plan, augmentation, seed, crops)
    return WorkerLoader(data, plan, augmentation, seed, crops, options.skip_bad_images)
