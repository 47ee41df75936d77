"""Where a run's images live, decode and get cropped, resolved once from data.loader, data.decode, data.crop,
data.gpu_share and data.num_workers with the device and the dataset: the `LoaderPlan` that src/data/loaders.py
builds and every report names."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, replace
from typing import Annotated, Literal

import torch

from src.config.errors import ConfigError
from src.config.schema import NonNegative, Range

log = logging.getLogger(__name__)

# data.num_workers=auto: a CPU worker per CPU (at most 16); GPU-decoding workers each hold a CUDA context, and 3
# fed an H100 best (docs/data.md)
AUTO_CPU_WORKERS, AUTO_GPU_DECODING_WORKERS = 16, 3
# data.decode=auto decodes on the CPU from this many workers per GPU where DALI is not installed: the model and
# nvjpeg share a GPU, so GPU decoding held ResNet-50 at 0.69x its ceiling where 15 CPU workers gave 0.97x and 4 gave
# 0.45x (bench/results/decode-default_4xh200_2026-11-28.md)
MIN_CPU_WORKERS = 6
# ... and from this many where it is: CPU decoding fed ResNet-50 0.70x, 0.79x and 0.88x what DALI did with 7, 11 and
# 13 workers, 1.02x with 15 (bench/results/decode-default-dali_h200_2026-11-29.md)
MIN_CPU_WORKERS_OVER_DALI = 15
# data.crop=auto with CPU-decoding workers on CUDA: the workers crop until the GPU is measured waiting for them this
# share of the time; then the training process crops. Cropping on the GPU was the faster on every host where the
# GPU waited 8 % or more, the slower on each where it waited under 5 % (bench/results/decode-default-more-hosts_*)
CROP_ON_DEVICE_GPU_WAIT = 0.08
DALI_INSTALL = "pip install nvidia-dali-cuda130"  # requirements.txt installs it on Linux x86-64 only


def dali_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:  # no `nvidia` namespace at all
        return False


@dataclass(frozen=True)
class LoaderOptions:
    """The data group's loader options (conf/data_common.yaml; decode and after: images read from disk)."""

    loader: Literal["auto", "resident", "workers"]  # resident: the dataset in device memory; workers: DataLoader
    num_workers: Literal["auto"] | Annotated[int, NonNegative]
    decode: Literal["auto", "gpu", "cpu", "split", "dali"] = "auto"
    gpu_share: Annotated[float, Range(0, 1, open_lo=True)] = 0.5  # decode=split: the share decoded on the GPU
    crop: Literal["auto", "workers", "device"] = "auto"
    skip_bad_images: bool = False

    def check(self, trivial: bool) -> None:
        """The combinations that cannot run, refused before any process starts. TrivialAugment runs per image in
        the CPU workers, after their crops."""
        if trivial and self.loader == "resident":
            raise ConfigError(
                "data.auto_augment=trivial runs per image in the CPU workers, not in data.loader=resident; "
                "use data.loader=workers (or auto)"
            )
        if trivial and (self.decode in ("gpu", "split", "dali") or self.crop == "device"):
            raise ConfigError(
                f"data.auto_augment=trivial runs in the CPU workers after their crops, not with "
                f"data.decode={self.decode} data.crop={self.crop}; set data.decode=cpu (or auto) and "
                "data.crop=workers (or auto)"
            )
        if self.decode == "dali":
            if not dali_installed():
                raise ConfigError(f"data.decode=dali needs NVIDIA DALI, which is not installed here: {DALI_INSTALL}")
            if self.skip_bad_images:
                raise ConfigError(
                    "data.skip_bad_images=true needs ddplab's decoders, which name each image they skip; "
                    "DALI stops at an unreadable one: set data.decode=auto, cpu or gpu"
                )
        if self.decode in ("gpu", "split", "dali") and self.crop == "workers":
            raise ConfigError(
                f"data.crop=workers needs data.decode=cpu: images decoded on the GPU (data.decode={self.decode}) "
                "are cropped by the training process; use data.crop=device (or auto)"
            )


@dataclass(frozen=True)
class LoaderPlan:
    """How batches are made. resident: the dataset lives in device memory and is augmented there, no workers.
    Else `workers` DataLoader processes fetch each batch; images read from disk are decoded (`decode`) on their
    CPUs (cpu), on the GPU (gpu), or both, each batch's `gpu_share` by `gpu_workers` more workers (split), and
    cropped by the workers or, `crop_on_device`, by the training process. dali: a DALI pipeline in the training
    process decodes and crops, with `workers` CPU threads (src/data/dali.py)."""

    resident: bool = False
    from_disk: bool = False  # each batch read (and decoded) from files
    decode: Literal["cpu", "gpu", "split", "dali"] | None = None  # None: the dataset gives pixels
    crop_on_device: bool = False
    workers: int = 0
    gpu_share: float = 0.0
    gpu_workers: int = 0
    crop_measured: bool = False  # data.crop=auto: `crop_on_device` settled by the GPU's wait (src/run/meter.py)

    @property
    def name(self) -> str:
        """What runs report (hparams `loader`): resident, workers, decode-cpu, decode-cpu-crop-device, decode-gpu
        or decode-split."""
        if self.resident:
            return "resident"
        if self.decode is None:
            return "workers"
        cropped = "-crop-device" if self.decode == "cpu" and self.crop_on_device else ""
        return f"decode-{self.decode}{cropped}"

    def settled(self, crop_on_device: bool) -> LoaderPlan:
        """This plan with data.crop=auto's measured choice made."""
        return replace(self, crop_on_device=crop_on_device, crop_measured=False)


def resolve_plan(
    options: LoaderOptions,
    device: torch.device,
    in_memory: bool,
    encoded: bool,
    trivial: bool,
    local_processes: int = 1,
) -> LoaderPlan:
    """The one place the auto choices are made. in_memory: the dataset is uint8 tensors; encoded: its splits are
    encoded images read from disk (src/data/decode.py); else a builder's own Dataset. trivial: TrivialAugment,
    which runs in CPU workers. local_processes: the training processes of this node (num_workers=auto shares
    its CPUs among them)."""
    loader = options.loader
    if loader == "auto":
        loader = "resident" if in_memory and device.type == "cuda" and not trivial else "workers"
    if loader == "resident":
        if not in_memory:
            raise ConfigError(
                "data.loader=resident needs a dataset that fits in memory; use data.loader=workers "
                "(data.decode=gpu decodes images read from disk on the GPU) or raise data.max_memory_gb"
            )
        return LoaderPlan(resident=True)
    if not encoded:
        if trivial and not in_memory:  # a builder's own Dataset: its workers do not augment
            raise ConfigError(
                "data.auto_augment=trivial runs in the workers of in-memory data, ImageFolders and shards, not in "
                "a data builder's own on-disk Dataset; set data.auto_augment=none"
            )
        workers = resolve_workers(options.num_workers, device, in_memory, False, local_processes)
        return LoaderPlan(from_disk=not in_memory, workers=workers)
    decode = options.decode
    if decode == "auto":
        cpu_workers = options.num_workers
        if cpu_workers == "auto":
            cpu_workers = auto_workers(local_processes, AUTO_CPU_WORKERS)
        cpu_only = (
            "data.auto_augment=trivial" if trivial else "data.crop=workers" if options.crop == "workers" else None
        )
        dali = dali_installed() and not options.skip_bad_images  # DALI cannot skip an image and name it
        decode, why = auto_decode(device.type, cpu_workers, cpu_only, dali)
        if device.type == "cuda":  # where there is a choice
            log.info("data.decode=auto: %s (%s); data.decode=cpu, gpu, split or dali chooses", decode, why)
    if decode == "dali":  # its threads take this process's CPUs, as workers would (at least one)
        threads = resolve_workers(options.num_workers, device, False, False, local_processes, False, "DALI threads", 1)
        return LoaderPlan(from_disk=True, decode="dali", crop_on_device=True, workers=max(1, threads))
    on_gpu = decode == "gpu"
    split = decode == "split"  # CPU workers decode, except each batch's GPU share; this process crops
    workers = resolve_workers(options.num_workers, device, False, on_gpu, local_processes, split)
    # workers that may crop on the CPU, feeding a GPU that may crop faster: measured in the first epoch
    measured = decode == "cpu" and options.crop == "auto" and device.type == "cuda" and workers > 0 and not trivial
    if on_gpu and device.type == "cuda" and not workers:
        log.warning(
            "data.decode=gpu with data.num_workers=0 decodes in the training process, where nvjpeg waits "
            "behind the step's kernels (~25x slower on an H100); set data.num_workers=3"
        )
    return LoaderPlan(
        from_disk=True,
        decode=decode,
        crop_on_device=on_gpu or split or options.crop == "device",
        crop_measured=measured,
        workers=workers,
        gpu_share=options.gpu_share if split else 0.0,
        gpu_workers=AUTO_GPU_DECODING_WORKERS if split else 0,
    )


def cpus_of_this_process(local_processes: int) -> int:
    """The CPUs this training process may use. The training processes of a node share its CPUs unless the
    launcher bound each to its own (e.g. SLURM's --cpus-per-task: an affinity no larger than one process's share)."""
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS: none
    if local_processes > 1 and mine > (os.cpu_count() or mine) // local_processes:
        return max(1, mine // local_processes)
    return mine


def resolve_workers(
    value,
    device: torch.device,
    in_memory: bool,
    decode_on_device: bool,
    local_processes: int,
    split: bool = False,
    what: str = "DataLoader workers",
    least: int = 0,
) -> int:
    """data.num_workers: an integer as given; auto: this process's CPUs but one (left to it), at most
    AUTO_CPU_WORKERS (AUTO_GPU_DECODING_WORKERS when the workers decode on the GPU); none for data in memory on a
    CPU device, where workers would take the cores the training step runs on. split (data.decode=split): the CPU
    workers, beside AUTO_GPU_DECODING_WORKERS that decode on the GPU and take CPUs too. what: what they are, for
    the log line (DALI's threads); least: the fewest auto gives."""
    if value != "auto":
        return value
    if in_memory and device.type == "cpu":
        return 0
    beside = AUTO_GPU_DECODING_WORKERS if split else 0  # they take CPUs too (file reads, nvjpeg's host stage)
    cap = AUTO_GPU_DECODING_WORKERS if decode_on_device else AUTO_CPU_WORKERS
    workers = max(1 if split else least, auto_workers(local_processes, cap, beside))
    also = f" and {beside} decoding on the GPU" if split else ""
    log.info(
        "data.num_workers=auto: %d %s%s (%d CPUs for this process, one kept for it)",
        workers,
        what,
        also,
        cpus_of_this_process(local_processes),
    )
    return workers


def auto_workers(local_processes: int, cap: int, beside: int = 0) -> int:
    """data.num_workers=auto: this process's CPUs but one (left to it) and `beside` (other workers), at most cap."""
    return max(0, min(cpus_of_this_process(local_processes) - 1 - beside, cap))


def auto_decode(device_type: str, cpu_workers: int, cpu_only: str | None = None, dali: bool = False) -> tuple[str, str]:
    """data.decode=auto: (decode, the reason in a few words). cpu_workers: the DataLoader workers this process gets
    when they decode; cpu_only: an option that needs the CPU workers to decode (its name), if any; dali: DALI is
    installed and may decode. With few CPUs per GPU, DALI fed ResNet-50 1.25x GPU-decoding workers
    (bench/results/dali-engine_h200_2026-11-29.md)."""
    if device_type != "cuda":
        return "cpu", "no GPU"
    if cpu_only:
        return "cpu", f"{cpu_only} runs in the CPU workers"
    if dali:
        if cpu_workers >= MIN_CPU_WORKERS_OVER_DALI:
            return "cpu", f"{cpu_workers} CPU workers per GPU decode as fast as DALI"
        few = f"{cpu_workers} CPU workers per GPU (fewer than {MIN_CPU_WORKERS_OVER_DALI})"
        return "dali", f"{few} decode slower than DALI, which decodes only each crop's box"
    if cpu_workers >= MIN_CPU_WORKERS:
        return "cpu", f"{cpu_workers} CPU workers per GPU decode faster than the GPU beside the model"
    few = f"{cpu_workers} CPU workers per GPU (fewer than {MIN_CPU_WORKERS})"
    return "gpu", f"{few} decode slower than the GPU; DALI is faster still: {DALI_INSTALL}"
