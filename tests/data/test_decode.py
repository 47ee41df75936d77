"""Images read from disk (issue 16): batched decoding on the device with a CPU fallback, random resized crops
drawn like torchvision's from (seed, epoch, sample id), the evaluation resize + centre crop, one-line errors for
bad files, and batches that are the same for any world size, decode path and resume point. All on the CPU,
where the "device" decoder is torchvision's CPU decoder."""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from src.config.errors import ConfigError
from src.data.datasets import load_data
from src.data.decode import as_tensor, decode_cpu, gpu_decodable
from src.data.disk_crops import DiskCrops, eval_geometry, resample, rrc_boxes, rrc_params, size_groups
from src.data.draws import sample_uniforms
from src.data.epoch import plan_epoch
from src.data.fetch import gpu_decoded
from src.data.loader_plan import cpus_of_this_process, dali_installed, resolve_workers
from src.data.loaders import WorkerLoader, build_loader
from src.run.trainer import train
from tests.conftest import make_cfg

CPU = torch.device("cpu")
DEFAULT = ((0.08, 1.0), (3 / 4, 4 / 3))


def encode(pixels: np.ndarray, kind: str) -> bytes:
    """An H x W x 3 image as a file of `kind`: jpeg, progressive, cmyk, gray, png."""
    from PIL import Image

    img, out = Image.fromarray(pixels), io.BytesIO()
    {
        "jpeg": lambda: img.save(out, "JPEG", quality=90),
        "progressive": lambda: img.save(out, "JPEG", quality=90, progressive=True),
        "cmyk": lambda: img.convert("CMYK").save(out, "JPEG", quality=90),
        "gray": lambda: img.convert("L").save(out, "JPEG", quality=90),
        "png": lambda: img.save(out, "PNG"),
    }[kind]()
    return out.getvalue()


def pil_rgb(data: bytes) -> torch.Tensor:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def write_tree(root: Path, kinds=("jpeg",), per_class=(6, 3), seed=0, smooth=False) -> None:
    """train/ and test/ with two classes of noise images of varied sizes, cycling through `kinds`; `smooth`:
    blobs a few pixels wide instead (decoders then differ by a level or two, chroma subsampling included)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in zip(("train", "test"), per_class):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                h, w = rng.integers(24, 72, 2)
                kind = kinds[i % len(kinds)]
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                if smooth:
                    pixels = np.array(Image.fromarray(pixels[:8, :8]).resize((int(w), int(h)), Image.BICUBIC))
                (root / split / c / f"{i}.{'png' if kind == 'png' else 'jpg'}").write_bytes(encode(pixels, kind))


def disk_data(tmp_path: Path, root: Path, *overrides: str):
    cfg = make_cfg(
        tmp_path,
        "data=imagefolder",
        f"data.root={root}",
        "data.image_size=16",
        "data.augment=random_resized_crop",
        "data.num_workers=0",
        "data.val_fraction=0",
        *overrides,
    )
    return load_data(cfg.data), cfg


def batches(data, cfg, steps, epoch, decode="gpu", eval_split=None, device=CPU, crop="auto"):
    with_decode = cfg.data.copy()
    with_decode.decode, with_decode.crop = decode, crop
    loader = build_loader(data, with_decode, device, device.type == "cuda", seed=7)
    name = {"gpu": "decode-gpu", "split": "decode-split"}.get(
        decode, "decode-cpu-crop-device" if crop == "device" else "decode-cpu"
    )
    assert isinstance(loader, WorkerLoader) and loader.plan.name == name
    try:
        if eval_split:
            return list(loader.eval_batches(eval_split, torch.arange(len(getattr(data, eval_split))), 4))
        return [(b.x, b.y) for b in loader.train_batches(steps, epoch)]
    finally:
        loader.close()


# --- the crop parameters: torchvision's distribution, from (seed, epoch, id) ---------------------------------


@pytest.mark.parametrize(
    "shape,scale,ratio",
    [((375, 500), *DEFAULT), ((500, 333), *DEFAULT), ((64, 64), *DEFAULT), ((300, 400), (0.25, 0.9), (0.5, 2.0))],
)
def test_crop_parameters_follow_torchvision_random_resized_crop(shape, scale, ratio):
    ks_2samp = pytest.importorskip("scipy.stats").ks_2samp
    n, (H, W) = 3000, shape
    ours, _ = rrc_params(3, 1, np.arange(n), [H] * n, [W] * n, scale, ratio)
    torch.manual_seed(0)
    image = torch.empty(3, H, W)
    ref = np.array([v2.RandomResizedCrop.get_params(image, list(scale), list(ratio)) for _ in range(n)])
    for boxes in (ours, ref):  # every box inside the image
        assert (boxes[:, :2] >= 0).all() and (boxes[:, 0] + boxes[:, 2] <= H).all()
        assert (boxes[:, 1] + boxes[:, 3] <= W).all() and (boxes[:, 2:] > 0).all()

    def features(b):  # area share, aspect, relative position
        return {
            "area": b[:, 2] * b[:, 3] / (H * W),
            "aspect": b[:, 3] / b[:, 2],
            "top": b[:, 0] / np.maximum(H - b[:, 2], 1),
            "left": b[:, 1] / np.maximum(W - b[:, 3], 1),
        }

    mine, theirs = features(ours), features(ref)
    for key in mine:
        assert ks_2samp(mine[key], theirs[key]).pvalue > 1e-3, key
        assert abs(mine[key].min() - theirs[key].min()) < 0.02 and abs(mine[key].max() - theirs[key].max()) < 0.05, key


@pytest.mark.parametrize("shape,scale", [((10, 200), (0.9, 1.0)), ((200, 10), (0.9, 1.0)), ((30, 30), (1.5, 2.0))])
def test_the_fallback_is_torchvision_centre_crop(shape, scale):
    """When no draw fits, torchvision crops the whole image to the nearest allowed aspect ratio, centred."""
    n, (H, W) = 50, shape
    ours, _ = rrc_params(0, 0, np.arange(n), [H] * n, [W] * n, scale, DEFAULT[1])
    expected = v2.RandomResizedCrop.get_params(torch.empty(3, H, W), list(scale), list(DEFAULT[1]))
    assert (ours == np.array(expected)).all()


def test_the_fallback_is_as_frequent_as_torchvision():
    n, (H, W) = 4000, (40, 400)  # most draws are too tall for this strip: most samples fall back
    u = sample_uniforms(1, 0, np.arange(n), 40).reshape(n, 10, 4)
    fallback = rrc_boxes(u, [H] * n, [W] * n)
    torch.manual_seed(1)
    ref = np.array(
        [v2.RandomResizedCrop.get_params(torch.empty(3, H, W), [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
    )
    centre = v2.RandomResizedCrop.get_params(torch.empty(3, H, W), [2.0, 2.0], [3 / 4, 4 / 3])  # always falls back
    rate, ref_rate = ((b == np.array(centre)).all(axis=1).mean() for b in (fallback, ref))
    assert 0.5 < ref_rate < 0.95 and abs(rate - ref_rate) < 0.05


def test_draws_depend_on_seed_epoch_and_id_only():
    ids = np.array([5, 0, 17, 3])
    alone = np.concatenate([sample_uniforms(2, 4, [i], 41) for i in ids])
    assert np.array_equal(sample_uniforms(2, 4, ids, 41), alone)  # batch-independent
    for other in ((3, 4), (2, 5)):
        assert not np.allclose(sample_uniforms(*other, ids, 41), alone)
    u = sample_uniforms(0, 0, np.arange(20000), 2)
    assert abs(u.mean() - 0.5) < 0.01 and 0 <= u.min() and u.max() < 1 and abs(np.corrcoef(u.T)[0, 1]) < 0.03


# --- the pixels: batched crops equal each image's own, evaluation equals Resize + CenterCrop ------------------


def random_images(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(20, 90, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def test_each_random_resized_crop_equals_its_own_reference():
    images, ids, size = random_images(12), torch.tensor([9, 2, 40, 7, 11, 0, 3, 5, 8, 1, 30, 31]), (16, 20)
    crops = DiskCrops(size, True, seed=5)
    batch = crops(images, ids, epoch=3)
    assert batch.dtype == torch.uint8 and batch.shape == (12, 3, *size)
    for k, (image, i) in enumerate(zip(images, ids.tolist())):
        (box,), (flip,) = rrc_params(5, 3, [i], [image.shape[1]], [image.shape[2]], *DEFAULT)  # this image alone
        top, left, h, w = box.tolist()
        ref = TF.resized_crop(image, top, left, h, w, list(size), antialias=True)
        by_hand = (
            F.interpolate(
                image[None, :, top : top + h, left : left + w].float(), size, mode="bilinear", antialias=True
            )[0]
            .round()
            .clamp(0, 255)
            .to(torch.uint8)
        )
        if flip:
            ref, by_hand = TF.horizontal_flip(ref), by_hand.flip(-1)
        assert (batch[k].int() - ref.int()).abs().max() <= 1 and (batch[k].int() - by_hand.int()).abs().max() <= 1


def test_evaluation_matches_resize_and_center_crop():
    from PIL import Image

    images, size = random_images(6, seed=1), (16, 16)
    batch = DiskCrops(size, True, seed=0)(images, torch.arange(6), epoch=None)  # evaluation: no randomness
    short = round(16 * 8 / 7)
    reference = v2.Compose([v2.Resize(short, antialias=True), v2.CenterCrop(size)])
    for image, got in zip(images, batch):
        assert torch.equal(got, reference(image))  # the tensor path: same kernel
        pil = reference(Image.fromarray(image.permute(1, 2, 0).numpy()))
        assert (got.int() - torch.from_numpy(np.array(pil)).permute(2, 0, 1).int()).abs().max() <= 2


def float_reference(image: torch.Tensor, box, resized, flip: bool, size) -> torch.Tensor:
    """One image through torch's own antialiased kernel in float (the per-image path the batched one replaces):
    crop `box`, resize to `resized`, keep the `size` window at `box`'s offset in it, mirror."""
    (top, left, h, w), (ot, ol) = box, resized[1]
    x = F.interpolate(
        image[None, :, top : top + h, left : left + w].float(), resized[0], mode="bilinear", antialias=True
    )
    x = x[0, :, ot : ot + size[0], ol : ol + size[1]].round().clamp(0, 255).to(torch.uint8)
    return x.flip(-1) if flip else x


@pytest.mark.parametrize("dtype, exact", [(torch.float32, 0.99), (torch.float16, 0.9)])
def test_batched_resample_equals_torchs_kernel_image_by_image(dtype, exact):
    """The device path's two matrix products per group of sizes give each image what F.interpolate gives it
    alone, within a level (rounding), for crops that shrink and crops that grow, with flips, evaluation's
    resize-then-centre-crop, and one big image that gets a padded group of its own."""
    images = random_images(11, seed=3) + [torch.randint(0, 256, (3, 300, 260), dtype=torch.uint8)]
    shapes = [tuple(image.shape[1:]) for image in images]
    assert [11] in size_groups(shapes)  # the big one is not padded together with the small ones
    size, rng = (24, 20), np.random.default_rng(0)
    boxes = rrc_boxes(rng.random((12, 10, 4)), *zip(*shapes))
    flips = rng.random(12) < 0.5
    zero = np.zeros(12, dtype=np.int64)
    rows = np.stack([boxes[:, 0], boxes[:, 2], zero + size[0], zero], axis=1)
    cols = np.stack([boxes[:, 1], boxes[:, 3], zero + size[1], zero], axis=1)
    got = resample(images, rows, cols, flips, size, dtype=dtype)
    want = torch.stack([float_reference(im, b, (size, (0, 0)), f, size) for im, b, f in zip(images, boxes, flips)])
    diff = (got.int() - want.int()).abs()
    assert got.shape == (12, 3, *size) and diff.max() <= 1 and (diff == 0).float().mean() >= exact
    pair = [
        torch.randint(0, 256, (3, 40, 44), dtype=torch.uint8),
        torch.randint(0, 256, (3, 38, 42), dtype=torch.uint8),
    ]
    assert size_groups([tuple(image.shape[1:]) for image in pair]) == [[1, 0]]  # one group, not in batch order
    spans = np.array([[2, 30, size[0], 0], [0, 38, size[0], 0]]), np.array([[1, 40, size[1], 0], [3, 35, size[1], 0]])
    two = resample(pair, *spans, np.array([False, True]), size, dtype=dtype)
    for image, got_one, (top, h), (left, w), flip in zip(pair, two, spans[0][:, :2], spans[1][:, :2], (False, True)):
        assert (
            got_one.int() - float_reference(image, (top, left, h, w), (size, (0, 0)), flip, size).int()
        ).abs().max() <= 1
    short = 27  # evaluation: the shorter side to 27, the centre 24 x 20
    geometry = [eval_geometry(h, w, short, size) for h, w in shapes]
    rows = np.array([(0, h, r[0], o[0]) for (h, _), (r, o) in zip(shapes, geometry)])
    cols = np.array([(0, w, r[1], o[1]) for (_, w), (r, o) in zip(shapes, geometry)])
    got = resample(images, rows, cols, np.zeros(12, dtype=bool), size, dtype=dtype)
    want = torch.stack(
        [float_reference(im, (0, 0, h, w), g, False, size) for im, (h, w), g in zip(images, shapes, geometry)]
    )
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() >= exact


# --- decoding: the device decoder where it can, the CPU for the rest ------------------------------------------


def test_what_the_device_decoder_gets_and_the_cpu_fallback():
    pixels = np.random.default_rng(0).integers(0, 256, (20, 28, 3), dtype=np.uint8)
    files = {kind: encode(pixels, kind) for kind in ("jpeg", "progressive", "cmyk", "gray", "png")}
    assert [kind for kind, data in files.items() if gpu_decodable(data)] == ["jpeg"]
    assert not gpu_decodable(files["jpeg"][:-100])  # truncated: no end marker
    for kind, data in files.items():
        image = decode_cpu(torch.frombuffer(bytearray(data), dtype=torch.uint8), kind)
        assert image.shape == (3, 20, 28) and torch.equal(image, pil_rgb(data)), kind


def test_mixed_formats_decode_alike_on_the_device_and_in_workers(tmp_path):
    """PNG, CMYK, grayscale and progressive files fall back to the CPU decoder inside the device path: the batches
    equal the CPU path's, bit for bit (on the CPU the device decoder is libjpeg too)."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png", "cmyk", "gray", "progressive"), per_class=(10, 5))
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    for gpu, cpu in zip(batches(data, cfg, steps, 2, "gpu"), batches(data, cfg, steps, 2, "cpu")):
        assert torch.equal(gpu[0], cpu[0]) and torch.equal(gpu[1], cpu[1])
    gpu, cpu = (batches(data, cfg, None, None, d, eval_split="test") for d in ("gpu", "cpu"))
    assert len(gpu) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(gpu, cpu))
    assert gpu[0][0].dtype == torch.float32 and gpu[0][0].shape == (4, 3, 16, 16)


@pytest.mark.parametrize("workers", [0, 2])
def test_cpu_decoding_with_the_crops_on_the_device_gives_the_same_batches(tmp_path, workers):
    """data.crop=device: the workers decode and cut (each training crop's region crosses to the training process,
    which resizes them batched on its device); the batches equal those of workers that crop, for training and
    evaluation."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png", "gray"), per_class=(10, 5))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", f"data.num_workers={workers}")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    device_crops = batches(data, cfg, steps, 2, "cpu", crop="device")
    worker_crops = batches(data, cfg, steps, 2, "cpu", crop="workers")
    assert len(device_crops) == len(worker_crops) == len(steps)
    for a, b in zip(device_crops, worker_crops):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    evals = [batches(data, cfg, None, None, "cpu", eval_split="test", crop=c) for c in ("device", "workers")]
    assert len(evals[0]) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(*evals))


class ShippedCropped:
    """The loader's DeviceFinish, noting for each batch whether the workers shipped it cropped."""

    def __init__(self, finish):
        self.finish, self.cropped = finish, []

    def from_pieces(self, pieces, split, epoch, order=None):  # on the CPU: join, then finish
        return self(self.finish.join(pieces), split, epoch, order)

    def __call__(self, batch, split, epoch, order=None):
        self.cropped.append(batch.shapes is None)
        return self.finish(batch, split, epoch, order)

    def close(self):
        self.finish.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_crops_handed_to_the_training_process_mid_epoch_give_the_same_batches(tmp_path, workers):
    """data.crop=auto settles where the crops run during an epoch (src/run/meter.py CropProbe): the batches asked
    for from then on come uncropped from the workers, the next epoch's too, and each batch is the one cropping
    workers give."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png"), per_class=(16, 4))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", f"data.num_workers={workers}")
    epochs = {e: plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=e) for e in (2, 3)}
    reference = {e: batches(data, cfg, steps, e, "cpu", crop="workers") for e, steps in epochs.items()}
    loader = build_loader(data, {**cfg.data, "decode": "cpu"}, CPU, False, seed=7)
    loader.finish = shipped = ShippedCropped(loader.finish)
    try:
        assert loader.plan.name == "decode-cpu" and len(epochs[2]) == 6
        got = loader.train_batches(epochs[2], 2)
        first = [next(got) for _ in range(2)]
        loader.settle_crops(True)
        assert loader.plan.name == "decode-cpu-crop-device"
        rest = list(got)
        loader.prepare(epochs[3], 3)
        later = list(loader.train_batches(epochs[3], 3))
    finally:
        loader.close()
    assert shipped.cropped == [True, True] + [False] * 4 + [False] * len(epochs[3])
    for (x, y), b in zip(reference[2] + reference[3], first + rest + later, strict=True):
        assert torch.equal(x, b.x) and torch.equal(y, b.y)


@pytest.mark.parametrize("decode", ["cpu", "gpu"])
def test_workers_that_leave_the_crops_to_the_device_send_only_each_training_crops_region(tmp_path, decode):
    """Workers that do not crop send, for training, each image cut to its crop's box (drawn from the whole image's
    size) and the flips, so about a crop's bytes cross, not a whole image's; for evaluation, whole images."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png"), per_class=(6, 3))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.crop=device")
    loader = build_loader(data, {**cfg.data, "decode": decode}, CPU, False, seed=7)
    ids = torch.arange(8)
    images = [decode_cpu(as_tensor(b), "") for b in data.train.files.read(ids)]
    shapes = [tuple(image.shape[1:]) for image in images]
    boxes, flips = rrc_params(7, 3, ids.numpy(), *zip(*shapes), *DEFAULT)
    assert (boxes[:, 2] * boxes[:, 3] < [h * w for h, w in shapes]).any()  # some crop smaller than its image
    sent = loader.fetch.__getitems__(("train", 3, ids.numpy(), False))
    assert sent.shapes.tolist() == [[3, h, w] for _, _, h, w in boxes.tolist()]
    regions = [image[:, y : y + h, x : x + w].reshape(-1) for image, (y, x, h, w) in zip(images, boxes.tolist())]
    assert torch.equal(sent.x, torch.cat(regions)) and torch.equal(sent.flips, torch.from_numpy(flips))
    sent = loader.fetch.__getitems__(("test", None, np.arange(4), False))
    assert sent.flips is None and sent.shapes[:, 1:].tolist() == [
        list(decode_cpu(as_tensor(b), "").shape[1:]) for b in data.test.files.read(range(4))
    ]


@pytest.mark.parametrize("crop", ["workers", "device"])
def test_cpu_decoding_spreads_a_batch_over_the_workers_and_joins_it_again(tmp_path, crop):
    """With CPU decoding a batch is fetched in pieces of MIN_PIECE (32) images or more, one per worker, so the
    first batch of a pass waits for one piece, not for one worker to decode a whole batch. Joined again, the
    batches equal those made in one piece, for training and evaluation."""
    write_tree(tmp_path / "tree", per_class=(40, 20))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=3", f"data.crop={crop}")
    steps = plan_epoch(len(data.train), 80, 1, 0, 1, seed=7, epoch=1)  # one batch of 80: pieces of 32, 32, 16
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        pieces = [(b.x, b.y) for b in loader.train_batches(steps, 1)]
        assert [len(request[2]) for request in loader.requests["all"].items] == [32, 32, 16]
        test_pieces = list(loader.eval_batches("test", torch.arange(len(data.test)), 40))
        assert [len(request[2]) for request in loader.requests["all"].items] == [32, 8]
    finally:
        loader.close()
    whole = batches(data, cfg, steps, 1, "cpu", crop=crop)
    one_worker = cfg.data.copy()
    one_worker.num_workers = 0
    loader = build_loader(data, one_worker, CPU, False, seed=7)
    try:
        test_whole = list(loader.eval_batches("test", torch.arange(len(data.test)), 40))
    finally:
        loader.close()
    for a, b in [*zip(pieces, whole, strict=True), *zip(test_pieces, test_whole, strict=True)]:
        assert a[0].shape[0] in (80, 40) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.fixture
def one_cpu():
    """This process bound to one CPU (as a launcher binds a task), for the length of a test."""
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    yield
    os.sched_setaffinity(0, cpus)


def test_auto_workers_are_this_process_cpus_but_one(one_cpu):
    """data.num_workers=auto (on-disk data's default): the CPUs this process may use, but one kept for it; the
    node's CPUs are shared by its training processes unless each is bound to its own."""
    os.sched_setaffinity(0, set(range(os.cpu_count())))  # every CPU, as a process started without a binding
    n = os.cpu_count()
    assert cpus_of_this_process(1) == n and cpus_of_this_process(2) == max(1, n // 2)
    cpu, cuda = CPU, torch.device("cuda", 0)
    assert resolve_workers(5, cpu, False, False, 1) == 5  # a number is kept
    assert resolve_workers("auto", cpu, False, False, 1) == min(n - 1, 16)  # CPU decoding
    assert resolve_workers("auto", cuda, False, True, 1) == min(n - 1, 3)  # GPU decoding: each holds a CUDA context
    assert resolve_workers("auto", cuda, False, False, 1, split=True) == max(1, min(n - 4, 16))  # 3 decode on GPU
    assert resolve_workers("auto", cpu, True, False, 1) == 0  # in memory on a CPU: the step needs those cores
    assert resolve_workers("auto", cuda, True, False, 2) == max(0, min(max(1, n // 2) - 1, 16))
    os.sched_setaffinity(0, {0})  # bound to one CPU (e.g. srun --cpus-per-task=1): nothing to spare
    assert cpus_of_this_process(1) == cpus_of_this_process(4) == 1
    assert resolve_workers("auto", cpu, False, False, 4) == 0
    assert resolve_workers("auto", cuda, False, False, 1, split=True) == 1  # split needs a CPU worker


def test_auto_workers_train_like_any_count_and_are_recorded(tmp_path, caplog):
    """The default data.num_workers=auto on an on-disk folder: the run says how many workers it started, records
    the count in metrics.json's hparams, and trains to the same numbers as loading in the training process."""
    write_tree(tmp_path / "tree", per_class=(12, 4))
    runs = {}
    caplog.set_level(logging.INFO, logger="src.data.loader_plan")
    for workers in ("auto", "0"):
        cfg = make_cfg(
            tmp_path / workers,
            "data=imagefolder",
            f"data.root={tmp_path / 'tree'}",
            "data.image_size=16",
            "data.augment=random_resized_crop",
            f"data.num_workers={workers}",
            "data.batch_size=8",
            "trainer.max_epochs=2",
        )
        runs[workers] = train(cfg), (tmp_path / workers / "run" / "metrics.json").read_text()
    cpus = len(os.sched_getaffinity(0))
    expected = max(0, min(cpus - 1, 16))
    assert f'"num_workers": {expected}' in runs["auto"][1] and '"num_workers": 0' in runs["0"][1]
    assert runs["auto"][0]["test_loss"] == runs["0"][0]["test_loss"]
    said = [r.getMessage() for r in caplog.records if r.name == "src.data.loader_plan"]
    line = f"data.num_workers=auto: {expected} DataLoader workers ({cpus} CPUs for this process, one kept for it)"
    assert said == [line]


SHARES_NO_DESCRIPTORS = """
import sys
from multiprocessing import resource_sharer
from pathlib import Path
import torch
from src.data.epoch import plan_epoch
from src.data.loaders import build_loader
from tests.data.test_decode import disk_data, write_tree
tmp = Path(sys.argv[1])
write_tree(tmp / "tree", per_class=(20, 4))
data, cfg = disk_data(tmp, tmp / "tree", "data.num_workers=2", "data.decode=cpu")
loader = build_loader(data, cfg.data, torch.device("cpu"), False, seed=7)
batches = [b.x for b in loader.train_batches(plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0), 0)]
loader.close()
print(len(batches), resource_sharer._resource_sharer._listener is None)
"""


def test_the_training_process_sends_its_workers_no_file_descriptors(tmp_path):
    """Sample ids go to the workers by value: as tensors, each piece crossed as a file descriptor, i.e. a socket
    handshake with the training process's descriptor-sharing thread, and a worker killed during one (the OOM
    killer) printed a traceback from that thread beside the one-line error."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", SHARES_NO_DESCRIPTORS, str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["5", "True"], proc.stdout


def test_a_piece_of_unreadable_images_is_skipped_and_a_batch_of_them_is_one_line(tmp_path, caplog):
    write_tree(tmp_path / "tree", per_class=(4, 20))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=3", "data.skip_bad_images=true")
    for i in range(32, 40):  # the second piece of the test batch
        Path(data.test.files.name(i)).write_bytes(b"nothing")
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        with caplog.at_level(logging.WARNING, logger="src.data.finish"):
            ((x, y),) = loader.eval_batches("test", torch.arange(len(data.test)), 40)
        assert len(x) == len(y) == 32 and torch.equal(y, data.test.labels[:32])
        assert loader.finish.skipped == 8
        with pytest.raises(ConfigError, match=r"^every image of a batch was unreadable .*; check the data$"):
            list(loader.eval_batches("test", torch.arange(32, 40), 40))
    finally:
        loader.close()


def test_a_dead_worker_is_raised_by_the_next_fetch_not_wherever_the_process_is(tmp_path):
    """torch's SIGCHLD handler raised a dead worker's error at any point of the training process (inside a
    logging call it was printed and swallowed); now the next fetch raises it."""
    import os
    import signal
    import time

    write_tree(tmp_path / "tree", per_class=(40, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.decode=cpu")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        batches = loader.train_batches(steps, 0)
        next(batches)
        os.kill(loader.loaders["all"]._iterator._workers[0].pid, signal.SIGKILL)
        time.sleep(1.0)  # the child's death is signalled meanwhile: nothing may be raised here
        with pytest.raises(RuntimeError, match=r"^DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
            list(batches)
    finally:
        loader.close()


def test_workers_run_below_the_training_process_priority(tmp_path):
    """On a host whose cores are all busy with workers, the training process must still get a core at once to
    feed its GPU: the workers run at a lower priority (a higher niceness) than the process that started them."""
    import time

    from src.data.fetch import WORKER_NICENESS

    write_tree(tmp_path / "tree", per_class=(40, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.decode=cpu")
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        next(loader.train_batches(plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0), 0))
        want = [min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS)] * 2
        deadline = time.monotonic() + 60  # the first batch can come before the other worker has started
        while True:
            workers = [os.getpriority(os.PRIO_PROCESS, w.pid) for w in loader.loaders["all"]._iterator._workers]
            if workers == want or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert workers == want
    finally:
        loader.close()


def test_the_next_epoch_goes_to_the_workers_during_the_evaluation_and_gives_the_same_batches(tmp_path):
    """prepare() sends the evaluation's pieces and then the next epoch's to the one set of workers, as one pass:
    the epoch starts with batches made. Taken in that order, they equal a fresh loader's; an evaluation left half
    taken, or an epoch other than the prepared one, falls back to a pass of its own and is still right."""
    write_tree(tmp_path / "tree", per_class=(24, 20))  # 48 training images, 40 test ones
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.decode=cpu")
    plans = {e: plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=e) for e in (0, 1, 2)}
    test_ids, evals = torch.arange(len(data.test)), [("test", torch.arange(len(data.test)), 8)]

    def xs(batches):
        return [b.x if hasattr(b, "x") else b[0] for b in batches]

    fresh = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        want = {e: xs(fresh.train_batches(plans[e], e)) for e in (1, 2)}
        want_test = xs(fresh.eval_batches("test", test_ids, 8))
    finally:
        fresh.close()
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        xs(loader.train_batches(plans[0], 0))
        loader.prepare(plans[1], 1, evals)
        got_test = xs(loader.eval_batches("test", test_ids, 8))
        # 5 test pieces; the workers were sent more before the epoch was asked for: its first pieces
        assert loader.loaders["all"]._iterator._send_idx > len(want_test)
        got = xs(loader.train_batches(plans[1], 1))
        assert loader.ahead is not None and not loader.ahead.segments  # taken from the prepared pass, not replaced
        for a, b in [*zip(got_test, want_test), *zip(got, want[1])]:
            assert torch.equal(a, b)
        assert len(got_test) == 5 and len(got) == len(want[1]) == 6
        loader.prepare(plans[1], 1, evals)
        next(loader.eval_batches("test", test_ids, 8))  # half an evaluation: the order of the pass is lost
        assert all(torch.equal(a, b) for a, b in zip(xs(loader.train_batches(plans[1], 1)), want[1]))
        loader.prepare(plans[1], 1, evals)
        xs(loader.eval_batches("test", test_ids, 8))
        assert all(torch.equal(a, b) for a, b in zip(xs(loader.train_batches(plans[2], 2)), want[2]))
    finally:
        loader.close()


def test_a_socket_error_from_a_worker_killed_mid_handover_is_its_death(tmp_path):
    """A batch's file descriptor is fetched over a socket from its worker; a worker killed during that handover
    (1 in 8 runs of the killed-worker CLI test under load) raised ConnectionResetError with a traceback, before
    torch saw the worker dead. Now the fetch waits for the death and says it in torch's words; with every worker
    alive the socket error stays what it is."""
    import os
    import signal

    from src.data.fetch import dead_workers

    write_tree(tmp_path / "tree", per_class=(40, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.decode=cpu")
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        batches = loader.train_batches(plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0), 0)
        next(batches)
        fetching = loader.loaders["all"]._iterator  # what _one_line_errors iterates
        assert dead_workers(fetching, grace=0.2) is None
        victim = fetching._workers[1].pid
        os.kill(victim, signal.SIGKILL)  # its death is seen within the grace, as after a reset socket
        died = dead_workers(fetching)
        assert (
            isinstance(died, RuntimeError) and str(died) == f"DataLoader worker (pid(s) {victim}) exited unexpectedly"
        )
    finally:
        loader.close()


@pytest.mark.parametrize("decode", ["gpu", "split"])
def test_gpu_decoding_with_the_crops_in_the_workers_is_one_line(tmp_path, decode):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    with pytest.raises(ConfigError, match=r"^data.crop=workers needs data.decode=cpu: .*use data.crop=device"):
        disk_data(tmp_path, tmp_path / "tree", f"data.decode={decode}", "data.crop=workers")


@pytest.mark.parametrize("share", [0, 1.5, "half"])
def test_a_gpu_share_outside_0_to_1_is_one_line(tmp_path, share):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    with pytest.raises(ConfigError, match=r"^data.gpu_share must be a number > 0 and <= 1"):
        disk_data(tmp_path, tmp_path / "tree", "data.decode=split", f"data.gpu_share={share}")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_file_is_one_line_naming_it_or_skipped(tmp_path, damage, caplog):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    bad = tmp_path / "tree/train/b/2.jpg"
    blob = bad.read_bytes()
    bad.write_bytes(blob[: len(blob) // 2] if damage == "truncated" else b"\xff\xd8 not a jpeg")
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)  # every training image in one batch
    for decode in ("gpu", "cpu"):
        with pytest.raises(ConfigError, match=rf"^{bad}: cannot read this image \(.*\); remove or replace the file$"):
            batches(data, cfg, steps, 0, decode)
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.skip_bad_images=true")
    with caplog.at_level(logging.WARNING, logger="src.data.finish"):
        ((x, y),) = batches(data, cfg, steps, 0, "gpu")
    assert len(x) == len(y) == 7
    assert any(str(bad) in r.getMessage() and "1 skipped so far" in r.getMessage() for r in caplog.records)


def test_a_worker_names_the_bad_file_in_one_line(tmp_path):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    bad = tmp_path / "tree/train/a/1.jpg"
    bad.write_bytes(b"nothing")
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=1")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)
    with pytest.raises(ConfigError) as info:
        batches(data, cfg, steps, 0, "cpu")
    assert str(info.value).startswith(f"{bad}: cannot read this image") and "\n" not in str(info.value)


def test_device_decoding_workers_start_with_spawn_and_give_the_same_batches(tmp_path):
    """On CUDA the decoding workers are spawned (CUDA cannot start in a forked child): what they need crosses by
    pickling, and their batches equal those decoded in the training process. On the CPU the same path runs when
    the loader is told its workers use CUDA; one worker, so that the order of arrival is the order asked."""
    write_tree(tmp_path / "tree", per_class=(9, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=gpu", "data.num_workers=1")
    steps = plan_epoch(len(data.train), 4, 1, 0, 1, seed=7, epoch=1)
    here = batches(data, cfg, steps, 1, "gpu")  # forked worker
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    loader.cuda_workers = True
    try:
        spawned = [(b.x, b.y) for b in loader.train_batches(steps, 1)]
        assert loader.loaders["all"].multiprocessing_context.get_start_method() == "spawn"
        test = list(loader.eval_batches("test", torch.arange(len(data.test)), 4))  # the same workers serve it
    finally:
        loader.close()
    assert len(spawned) == len(here) == len(steps) and len(test) == 1
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(spawned, here))


@pytest.mark.parametrize("spawn", [False, True])
def test_split_decoding_shares_each_batch_and_gives_the_batches_of_cpu_decoding(tmp_path, spawn):
    """data.decode=split: the GPU-decoding workers get exactly each batch's gpu_decoded ids, the CPU workers the
    rest in pieces; joined in the batch's order, the batches equal those of CPU decoding with the crops on the
    device (on the CPU both decoders are libjpeg), for training and evaluation, with PNG and grayscale files among
    them. spawn: the GPU-decoding workers started as on CUDA."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png", "gray"), per_class=(30, 10))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.decode=split", "data.gpu_share=0.4")
    steps = plan_epoch(len(data.train), 64, 1, 0, 1, seed=7, epoch=2)
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    loader.cuda_gpu_workers = spawn
    try:
        split = [(b.x, b.y) for b in loader.train_batches(steps, 2)]
        asked = [torch.from_numpy(request[2]) for request in loader.requests["gpu"].items]
        evals = list(loader.eval_batches("test", torch.arange(len(data.test)), 16))
        start = loader.loaders["gpu"].multiprocessing_context.get_start_method()
    finally:
        loader.close()
    assert loader.plan.name == "decode-split" and start == ("spawn" if spawn else "fork")
    wanted = [ids[gpu_decoded(ids, 0.4)] for step in steps for ids in step.micro]
    assert len(asked) == len(wanted) and all(torch.equal(a, b) for a, b in zip(asked, wanted))
    assert 0 < sum(map(len, asked)) < len(steps) * 64  # both kinds of worker had work
    cpu = batches(data, cfg, steps, 2, "cpu", crop="device")
    cpu_evals = batches(data, cfg, None, None, "cpu", eval_split="test", crop="device")
    for a, b in zip(split, cpu, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for k in (0, 1):  # evaluation batches of 16 here, of 4 there
        assert torch.equal(torch.cat([b[k] for b in evals]), torch.cat([b[k] for b in cpu_evals]))


def test_a_split_run_trains_like_cpu_decoding_and_records_its_share(tmp_path):
    """train() with data.decode=split on the CPU: the same numbers as CPU decoding with the crops on the device,
    and metrics.json's hparams say which loader and which share (0 for the other loaders)."""
    write_tree(tmp_path / "tree", per_class=(12, 4))
    runs = {}
    for name, decode in (("split", ["data.decode=split", "data.gpu_share=0.4"]), ("cpu", ["data.decode=cpu"])):
        cfg = make_cfg(
            tmp_path / name,
            "data=imagefolder",
            f"data.root={tmp_path / 'tree'}",
            "data.image_size=16",
            "data.augment=random_resized_crop",
            "data.num_workers=1",
            "data.crop=device",
            "data.batch_size=8",
            "trainer.max_epochs=2",
            *decode,
        )
        final = train(cfg)
        runs[name] = final, json.loads((tmp_path / name / "run" / "metrics.json").read_text())
    assert runs["split"][0]["test_loss"] == runs["cpu"][0]["test_loss"]
    losses = [[e["train_loss"] for e in runs[name][1]["epochs"]] for name in ("split", "cpu")]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    runs = {name: (final, metrics["hparams"]) for name, (final, metrics) in runs.items()}
    assert (runs["split"][1]["loader"], runs["split"][1]["gpu_share"]) == ("decode-split", 0.4)
    assert (runs["cpu"][1]["loader"], runs["cpu"][1]["gpu_share"]) == ("decode-cpu-crop-device", 0.0)


def test_split_decoding_chooses_by_sample_id_alone():
    ids = torch.arange(20_000)
    mask = gpu_decoded(ids, 0.3)
    assert abs(mask.float().mean().item() - 0.3) < 0.01
    shuffled = ids[torch.randperm(len(ids))]
    assert torch.equal(gpu_decoded(shuffled, 0.3), mask[shuffled])  # whatever batch or rank the id is in
    assert gpu_decoded(ids, 1.0).all()


# --- the same batches for any world size and after a resume ---------------------------------------------------


def test_two_ranks_see_exactly_the_single_rank_batch(tmp_path):
    write_tree(tmp_path / "tree", per_class=(9, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    single = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=1)
    one = batches(data, cfg, single, 1)
    ranks = [plan_epoch(len(data.train), 8, 2, r, 1, seed=7, epoch=1) for r in (0, 1)]
    two = [batches(data, cfg, plan, 1) for plan in ranks]
    for k, step in enumerate(single):
        by_id = dict(zip(step.micro[0].tolist(), one[k][0]))
        union = [(i, x) for r in (0, 1) for i, x in zip(ranks[r][k].micro[0].tolist(), two[r][k][0])]
        assert sorted(i for i, _ in union) == sorted(by_id)
        assert all(torch.equal(x, by_id[i]) for i, x in union)


def test_a_resumed_epoch_crops_each_sample_the_same_way(tmp_path):
    write_tree(tmp_path / "tree", per_class=(9, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 4, 1, 0, 1, seed=7, epoch=1)
    full = batches(data, cfg, steps, 1)
    resumed = batches(data, cfg, steps[2:], 1)  # what a run resumed at step 2 asks for, in a fresh loader
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[2:], resumed))
    assert not torch.equal(batches(data, cfg, steps, 2)[0][0], full[0][0])  # another epoch, other crops


# --- on CUDA (the GPU machine): nvjpeg and the side stream --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kinds", [("jpeg",), ("jpeg", "png", "cmyk", "gray", "progressive")])
def test_cuda_decoding_matches_the_cpu_path(tmp_path, kinds):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    write_tree(tmp_path / "tree", kinds=kinds, per_class=(10, 5), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    cuda = batches(data, cfg, steps, 2, "gpu", device=torch.device("cuda"))
    cpu = batches(data, cfg, steps, 2, "cpu")
    elsewhere = batches(data, cfg, steps, 3, "cpu")  # the same images cropped as in another epoch
    std = torch.tensor(data.std).view(1, 3, 1, 1)
    for (x, y), (ref, ref_y), (other, _) in zip(cuda, cpu, elsewhere):
        assert x.is_cuda and x.is_contiguous(memory_format=torch.channels_last) and torch.equal(y.cpu(), ref_y)
        # nvjpeg (the H100's hardware decoder: its own IDCT and chroma upsampling) and float resizing: a few
        # levels apart (mean 3.2 seen on an H100); a crop from elsewhere differs by many more
        levels = ((x.cpu() - ref) * std * 255).abs().mean()
        assert levels < 5 and levels < ((other - ref) * std * 255).abs().mean() / 3


@pytest.mark.gpu
def test_cpu_decoding_with_the_crops_on_cuda_matches_cropping_workers(tmp_path):
    """data.crop=device on CUDA: libjpeg decodes in the workers, the GPU crops; only float rounding differs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    write_tree(tmp_path / "tree", kinds=("jpeg", "png"), per_class=(10, 5), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    cuda = batches(data, cfg, steps, 2, "cpu", device=torch.device("cuda"), crop="device")
    cpu = batches(data, cfg, steps, 2, "cpu", crop="workers")
    std = torch.tensor(data.std).view(1, 3, 1, 1)
    assert len(cuda) == len(cpu) == len(steps)
    for (x, y), (ref, ref_y) in zip(cuda, cpu):
        assert x.is_cuda and torch.equal(y.cpu(), ref_y)
        levels = ((x.cpu() - ref) * std * 255).abs()  # the same crops: rounding (TF32 matmuls) moves a few pixels
        assert levels.mean() < 0.5 and levels.max() < 3.01  # by a level or two; another crop: ~50 levels


@pytest.mark.gpu
def test_host_batches_finished_on_their_own_stream_reach_the_step_intact(tmp_path):
    """CPU-decoded batches are copied and normalized on a CUDA stream of the loader's. The step's stream waits for
    each (the loader's stream held busy: the step must not read the batch early), and a batch's memory is not
    reused while the step's stream still reads it (that stream held busy: later batches must not overwrite it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    write_tree(tmp_path / "tree", kinds=("jpeg",), per_class=(12, 2), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    ref = batches(data, cfg, steps, 2, "cpu", crop="workers")
    cfg.data.decode, cfg.data.crop = "cpu", "workers"
    for busy in ("loader", "step"):
        loader = build_loader(data, cfg.data, torch.device("cuda"), True, seed=7)
        try:
            read = []
            for k, batch in enumerate(loader.train_batches(steps, 2)):
                if k == 0:  # ~1 s of spinning on one stream: the other runs ahead of it
                    with torch.cuda.stream(loader.finish.stream if busy == "loader" else torch.cuda.current_stream()):
                        torch.cuda._sleep(2_000_000_000)
                read.append((batch.x.clone(), batch.y.clone()))  # queued on the step's stream
            torch.cuda.synchronize()
        finally:
            loader.close()
        assert len(read) == len(ref) == len(steps)
        for (x, y), (ref_x, ref_y) in zip(read, ref):
            assert torch.equal(y.cpu(), ref_y), busy
            assert (x.cpu() - ref_x).abs().max() < 1e-5, busy


@pytest.mark.gpu
def test_split_decoding_on_cuda_gives_each_sample_as_its_decoder_does(tmp_path):
    """data.decode=split on CUDA: the samples gpu_decoded chooses come as GPU decoding gives them (nvjpeg in
    spawned workers), the others as CPU decoding with the crops on the device does; only float rounding differs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    write_tree(tmp_path / "tree", kinds=("jpeg", "png"), per_class=(16, 4), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.num_workers=2", "data.gpu_share=0.5")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=2)
    cuda = torch.device("cuda")
    split = batches(data, cfg, steps, 2, "split", device=cuda)
    gpu = batches(data, cfg, steps, 2, "gpu", device=cuda)
    cpu = batches(data, cfg, steps, 2, "cpu", device=cuda, crop="device")
    std = torch.tensor(data.std, device=cuda).view(1, 3, 1, 1)
    assert len(split) == len(gpu) == len(cpu) == len(steps)
    chosen = 0
    for step, (x, y), g, c in zip(steps, split, gpu, cpu):
        on_gpu = gpu_decoded(step.micro[0], 0.5).to(cuda)
        ref = torch.where(on_gpu.view(-1, 1, 1, 1), g[0], c[0])
        levels = ((x - ref) * std * 255).abs()
        assert torch.equal(y, c[1]) and levels.mean() < 0.5 and levels.max() < 3.01
        chosen += int(on_gpu.sum())
    assert 0 < chosen < len(steps) * 8


@pytest.mark.gpu
@pytest.mark.parametrize("decode", ["gpu", "dali"])
def test_cuda_training_with_gpu_decoding_and_cuda_graphs(tmp_path, decode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if decode == "dali" and not dali_installed():
        pytest.skip("needs DALI (requirements.txt installs it on Linux x86-64 only)")
    write_tree(tmp_path / "tree", per_class=(16, 4))
    _, cfg = disk_data(
        tmp_path,
        tmp_path / "tree",
        "trainer.device=cuda",
        f"data.decode={decode}",
        "data.batch_size=8",
        "trainer.compile=true",
        "trainer.compile_mode=reduce-overhead",
        "trainer.max_epochs=2",
    )
    metrics = train(cfg)
    assert metrics["test_count"] == 8 and np.isfinite(metrics["test_loss"])
