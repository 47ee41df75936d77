"""data.decode=dali: images read from disk, decoded, cropped and resized by an NVIDIA DALI pipeline in the training
process. DALI decodes in threads of its own, outside Python's interpreter lock, and on the GPU's hardware JPEG
decoder where there is one: where a host has few CPUs per GPU, it keeps the GPU fed where DataLoader workers
cannot (docs/data.md). It decodes only each training crop's region.

ddplab still draws every crop and flip from (seed, epoch, sample id) (src/data/disk_crops.py) and passes them in, so
the batches hold the same crops of the same samples as on every other path, for any strategy, world size or
resume; the pixels differ from the CPU path's by DALI's JPEG decoder (as nvjpeg's do, data.decode=gpu) and resize
filter.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from src.config.errors import ConfigError
from src.data.datasets import DataBundle
from src.data.decode import encoded_size
from src.data.disk_crops import DiskCrops, eval_geometry, rrc_params
from src.data.fetch import SPLITS, Fetched

log = logging.getLogger(__name__)

# batches handed to DALI ahead of the one the trainer takes: its threads and the GPU decode them meanwhile
AHEAD = 3
# the first bytes of the formats DALI's decoders read (JPEG, PNG, BMP, TIFF, PNM, JPEG 2000); WEBP: RIFF....WEBP
DALI_FORMATS = (b"\xff\xd8\xff", b"\x89PNG", b"BM", b"II*\x00", b"MM\x00*", b"\x00\x00\x00\x0cjP", b"\xffO\xffQ")
DALI_FORMATS += tuple(f"P{k}".encode() for k in range(1, 7))
# from this many threads they outpace the GPU's hardware JPEG decoder: 1.13x the images/s with it off with 7 and 15
# threads per H200, 0.90x with 3 (bench/results/dali-engine_h200_2026-11-29.md)
HW_DECODER_OFF_FROM_THREADS = 6


def dali_reads(data) -> bool:
    """Whether DALI's decoders take this file, from its first bytes (GIF, for one, only the CPU path reads)."""
    head = bytes(memoryview(data)[:12])
    return head.startswith(DALI_FORMATS) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def decoder_options(gpu: bool, threads: int) -> dict[str, float]:
    """The GPU decoder's options for this many DALI threads: the hardware JPEG decoder off from
    HW_DECODER_OFF_FROM_THREADS, DALI's own share for it below."""
    return {"hw_decoder_load": 0.0} if gpu and threads >= HW_DECODER_OFF_FROM_THREADS else {}


class DaliCrops:
    """Each batch of sample ids -> Fetched uint8 crops (B x 3 x size, channels_last) on `device`: a training
    batch's random resized crops, else each image's centre crop (`DiskCrops`' geometry). One pipeline for both:
    decode the box, resize it, cut the centre, mirror. On a CPU device DALI runs on the CPU."""

    def __init__(self, data: DataBundle, crops: DiskCrops, device: torch.device, threads: int):
        self.splits = {k: getattr(data, k) for k in SPLITS}
        self.crops, self.device, self.threads = crops, device, threads
        self.sizes = {k: np.full((len(self.splits[k]), 2), -1, dtype=np.int64) for k in SPLITS}  # read once
        self.pipe, self.capacity = None, 0
        self.decoder = decoder_options(device.type == "cuda", threads)
        if device.type == "cuda":
            engine = "off" if self.decoder else "on, at DALI's default share"
            log.info("DALI: %d threads, the GPU's hardware JPEG decoder %s", threads, engine)
        # a thread reads each batch and draws its crops while the trainer steps, off the training thread
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="dali-read")
        self.reading: collections.deque[tuple[str, torch.Tensor, Future]] = collections.deque()
        self.pending: collections.deque = collections.deque()  # (split, ids, inputs) handed to DALI, not yet taken

    def _build(self, capacity: int) -> None:
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device.type == "cuda"

        # depth 1: ddplab hands in batches ahead itself (AHEAD); DALI's own prefetching waits for inputs given
        # ahead of each batch taken
        @pipeline_def(
            batch_size=capacity,
            num_threads=self.threads,
            device_id=self.device.index if gpu else None,
            prefetch_queue_depth=1,
        )
        def crops():
            def given(name, dtype, ndim=1):  # no_copy: the inputs are kept until their batch is taken
                return fn.external_source(name=name, dtype=dtype, ndim=ndim, no_copy=True)

            data = given("bytes", types.UINT8)
            box_at, box, resized = (
                given("box_at", types.INT32),
                given("box", types.INT32),
                given("resized", types.FLOAT),
            )
            images = fn.decoders.image_slice(
                data,
                box_at,
                box,
                device="mixed" if gpu else "cpu",
                output_type=types.RGB,
                axis_names="HW",
                adjust_orientation=False,  # as decode_cpu: the stored orientation
                **self.decoder,
            )
            images = fn.resize(images, size=resized, antialias=True)
            # the cut and the mirror in one operator, uint8 in and out (mean 0, std 1: no normalizing)
            return fn.crop_mirror_normalize(
                images,
                crop=list(self.crops.size),
                crop_pos_y=given("cut_y", types.FLOAT, ndim=0),
                crop_pos_x=given("cut_x", types.FLOAT, ndim=0),
                rounding="round",
                mirror=given("flip", types.INT32, ndim=0),
                dtype=types.UINT8,
                output_layout="HWC",
                mean=0.0,
                std=1.0,
            )

        self.pipe = crops()
        self.pipe.build()
        self.capacity = capacity

    def _sizes(self, split: str, ids: np.ndarray, datas: list) -> np.ndarray:
        """(height, width) of each image, read from its header the first time it is asked for; then whether DALI
        takes its format."""
        sizes, files = self.sizes[split], self.splits[split].files
        for k in np.flatnonzero(sizes[ids, 0] < 0).tolist():
            name = files.name(int(ids[k]))
            size = encoded_size(datas[k], name)
            if not dali_reads(datas[k]):
                formats = "JPEG, PNG, BMP, TIFF, PNM, JPEG 2000, WEBP"
                raise ConfigError(f"{name}: not a format DALI decodes ({formats}); use data.decode=cpu")
            sizes[ids[k]] = size
        return sizes[ids]

    def _inputs(self, split: str, epoch: int | None, ids: torch.Tensor) -> dict[str, object]:
        """One batch's inputs to DALI (in the reader thread): the bytes, and where each image is cut, resized to
        and cropped."""
        files, n = self.splits[split].files, len(ids)
        datas = files.read(ids.tolist())
        for data in datas:
            if isinstance(data, ConfigError):
                raise data
        rows = ids.numpy()
        sizes = self._sizes(split, rows, datas)
        heights, widths = sizes[:, 0].tolist(), sizes[:, 1].tolist()
        if epoch is not None and self.crops.random:  # the training crops: the box, resized to the size
            boxes, flips = rrc_params(self.crops.seed, epoch, rows, heights, widths, self.crops.scale, self.crops.ratio)
            box_at, box = boxes[:, :2], boxes[:, 2:]
            resized, cut_at = np.tile(np.asarray(self.crops.size), (n, 1)), np.zeros((n, 2))
        else:  # the whole image, its shorter side resized to `short`, then the centre
            geometry = [eval_geometry(h, w, self.crops.short, self.crops.size) for h, w in zip(heights, widths)]
            box_at, box, flips = np.zeros((n, 2)), sizes, np.zeros(n, dtype=bool)
            resized, cut_at = (np.array([g[k] for g in geometry]) for k in (0, 1))
        # where the cut starts, as a share of the room the resized image leaves around it (0 when it leaves none)
        room = np.maximum(resized - np.asarray(self.crops.size), 1)
        cut_y, cut_x = (cut_at / room).T
        inputs: dict[str, object] = {"bytes": [np.frombuffer(data, dtype=np.uint8) for data in datas]}
        for name, value, dtype in (
            ("box_at", box_at, np.int32),
            ("box", box, np.int32),
            ("resized", resized, np.float32),
            ("cut_y", cut_y, np.float32),
            ("cut_x", cut_x, np.float32),
            ("flip", flips, np.int32),
        ):
            inputs[name] = np.ascontiguousarray(value, dtype=dtype)
        return inputs

    def _read(self, split: str, epoch: int | None, ids: torch.Tensor) -> None:
        self.reading.append((split, ids, self.reader.submit(self._inputs, split, epoch, ids)))

    def _give(self) -> None:
        """Hand DALI the oldest batch read."""
        split, ids, future = self.reading.popleft()
        inputs = future.result()
        for name, value in inputs.items():
            self.pipe.feed_input(name, value)
        self.pipe.schedule_run()
        self.pending.append((split, ids, inputs))

    def _take(self) -> Fetched:
        """The oldest batch handed in, as a Fetched of uint8 NCHW (channels_last) images on the device."""
        split, ids, inputs = self.pending.popleft()  # DALI reads `inputs` in place (no_copy): held until we return
        cuda = self.device.type == "cuda"
        stream = torch.cuda.current_stream(self.device) if cuda else None
        try:
            (out,) = self.pipe.share_outputs(stream)  # ready in the order of this process's stream
        except RuntimeError as exc:  # DALI's pipeline is no longer usable after an error
            self.pipe = None
            raise self._unreadable(split, ids, str(exc)) from None
        try:
            dense = out.as_tensor()
            if cuda:
                from nvidia.dali.plugin.pytorch import feed_ndarray

                x = torch.empty(dense.shape(), dtype=torch.uint8, device=self.device)
                feed_ndarray(dense, x, cuda_stream=stream)
            else:
                x = torch.from_numpy(np.array(dense))
        finally:
            self.pipe.release_outputs()
        return Fetched(x.permute(0, 3, 1, 2), self.splits[split].labels[ids], ids)

    def _unreadable(self, split: str, ids: torch.Tensor, said: str) -> ConfigError:
        """DALI's error as one line: the file named where DALI says which sample of the batch failed."""
        failed = re.search(r"sample #(\d+)", said)
        if failed and int(failed[1]) < len(ids):
            name = self.splits[split].files.name(int(ids[int(failed[1])]))
            return ConfigError(
                f"{name}: DALI could not decode this image; remove or replace the file (data.decode=cpu reads more "
                "formats and names what is wrong)"
            )
        return ConfigError(f"DALI could not decode an image of this {split} batch; data.decode=cpu names the file")

    def __call__(self, split: str, epoch: int | None, batches: list[torch.Tensor]) -> Iterator[Fetched]:
        """The batches of sample ids of one pass, in order: AHEAD of them in DALI and one more read at a time."""
        self._drop()
        biggest = max(map(len, batches), default=0)
        if self.pipe is None or biggest > self.capacity:
            self._build(max(biggest, self.capacity))
        waiting = iter(batches)
        for ids in itertools.islice(waiting, AHEAD + 1):
            self._read(split, epoch, ids)
        while self.reading and len(self.pending) < AHEAD:
            self._give()
        while self.pending:
            fetched = self._take()
            if self.reading:
                self._give()
            ids = next(waiting, None)
            if ids is not None:
                self._read(split, epoch, ids)
            yield fetched

    def _drop(self) -> None:
        """What a pass left before its end (an evaluation limit, a stop, an error) left behind: its batches."""
        while self.reading:
            self.reading.popleft()[2].exception()  # wait for the read; its result or error is not wanted
        if self.pipe is None:  # no pipeline yet, or one DALI gave up on: nothing handed in can come out
            self.pending.clear()
        while self.pending:
            self._take()

    def close(self) -> None:
        self.reader.shutdown(wait=True, cancel_futures=True)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="dali-read")  # an idle pool has no thread
        self.pipe, self.pending, self.reading = None, collections.deque(), collections.deque()
