"""data.decode=dali (src/data/dali.py): NVIDIA DALI decodes and crops in the training process, with the crops and
flips ddplab draws. DALI's real pipeline runs here on the CPU; on the GPU machine the gpu-marked tests run it with
its "mixed" (GPU) decoder. The reference is ddplab's CPU path (data.decode=cpu)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from src.config.errors import ConfigError
from src.data.dali import decoder_options
from src.data.epoch import plan_epoch
from src.data.loader_plan import LoaderOptions, resolve_plan
from src.data.loaders import DaliLoader, build_loader
from src.run.launch import main as launch
from src.run.trainer import train
from src.state.checkpoint import find
from tests.conftest import assert_same_weights, make_cfg, read_metrics
from tests.data.test_decode import disk_data, one_cpu, write_tree  # noqa: F401 (one_cpu: a fixture)

pytest.importorskip("nvidia.dali", reason="needs DALI (requirements.txt installs it on Linux x86-64 only)")

KINDS = ("jpeg", "png", "cmyk", "gray", "progressive")
CPU = torch.device("cpu")


def dali_and_cpu(data, cfg, run, device=CPU):
    """run(loader) with data.decode=dali on `device`, and with data.decode=cpu on the CPU."""
    out = {}
    for decode, on in (("dali", device), ("cpu", CPU)):
        options = cfg.data.copy()
        options.decode = decode
        loader = build_loader(data, options, on, on.type == "cuda", seed=7)
        assert isinstance(loader, DaliLoader) == (decode == "dali")
        assert loader.plan.name == f"decode-{decode}"
        try:
            out[decode] = run(loader)
        finally:
            loader.close()
    return out["dali"], out["cpu"]


def epoch_and_test(steps, epoch, tests: int):
    """run(loader) for dali_and_cpu: the epoch's training batches, then the test split's in batches of 4."""

    def run(loader):
        train_batches = [(b.x.cpu(), b.y.cpu()) for b in loader.train_batches(steps, epoch)]
        test = loader.eval_batches("test", torch.arange(tests), 4) if tests else []
        return train_batches, [(x.cpu(), y.cpu()) for x, y in test]

    return run


def levels(a: torch.Tensor, b: torch.Tensor, data) -> torch.Tensor:
    """|a - b| in 0..255 levels of normalized batches."""
    return ((a - b) * torch.tensor(data.std).view(1, 3, 1, 1) * 255).abs()


def dali_epoch(data, cfg, steps, epoch: int) -> list[torch.Tensor]:
    """The images of each training batch of `steps` from a fresh loader of `cfg` (data.decode=dali), closed after."""
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        return [b.x for b in loader.train_batches(steps, epoch)]
    finally:
        loader.close()


def test_dali_gives_the_cpu_paths_crops_of_every_format(tmp_path):
    """Training crops (random resized, drawn by ddplab) and evaluation centre crops, for JPEG (progressive,
    grayscale, CMYK) and PNG: the same samples and labels in the same order, the pixels a level or so apart
    (DALI's resize filter; its CPU JPEG decoder is libjpeg-turbo too), far closer than another epoch's crops."""
    write_tree(tmp_path / "tree", kinds=KINDS, per_class=(10, 5), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)
    (dali, dali_test), (cpu, cpu_test) = dali_and_cpu(data, cfg, epoch_and_test(steps, 2, len(data.test)))
    _, (elsewhere, _) = dali_and_cpu(data, cfg, epoch_and_test(steps, 3, 0))  # the same samples, other crops
    assert len(dali) == len(cpu) == len(steps) and len(dali_test) == len(cpu_test) == 3
    for (x, y), (ref, ref_y) in zip(dali + dali_test, cpu + cpu_test):
        assert x.shape == ref.shape and x.dtype == torch.float32 and torch.equal(y, ref_y)
        apart = levels(x, ref, data)
        assert apart.mean() < 0.5 and apart.max() <= 6.01
    assert levels(dali[0][0], cpu[0][0], data).mean() * 10 < levels(dali[0][0], elsewhere[0][0], data).mean()


@pytest.mark.parametrize("kind", ["rgba.png", "16bit.png", "palette.png", "bmp", "webp", "tif"])
def test_dali_reads_the_other_formats_as_the_cpu_path(tmp_path, kind):
    """Alpha dropped, 16-bit samples cut to 8, palettes expanded, BMP, lossless WEBP and TIFF: as decode_cpu reads
    them, within the resize filter's rounding."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = np.array(Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((40, 30), 3))
    image = {
        "rgba.png": lambda: Image.fromarray(pixels).convert("RGBA"),
        "16bit.png": lambda: Image.fromarray(pixels[..., 0].astype(np.uint16) * 257),
        "palette.png": lambda: Image.fromarray(pixels).convert("P"),
    }.get(kind, lambda: Image.fromarray(pixels))()
    for split, n in (("train", 4), ("test", 2)):
        for c in ("a", "b"):
            (tmp_path / "tree" / split / c).mkdir(parents=True)
            for i in range(n):
                image.save(
                    tmp_path / "tree" / split / c / f"{i}.{kind.split('.')[-1]}",
                    **({"lossless": True} if kind == "webp" else {}),
                )
    data, cfg = disk_data(tmp_path, tmp_path / "tree")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)
    (dali, _), (cpu, _) = dali_and_cpu(data, cfg, epoch_and_test(steps, 0, 0))
    assert levels(dali[0][0], cpu[0][0], data).mean() < 0.5


def test_two_ranks_and_a_resumed_epoch_get_the_single_rank_crops(tmp_path):
    """The crops come from (seed, epoch, sample id): each sample is the same image whether one rank or two ask for
    it, and when a resumed epoch starts at its third step in a fresh loader."""
    write_tree(tmp_path / "tree", per_class=(9, 2))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    single = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=1)
    ranks = [plan_epoch(len(data.train), 8, 2, r, 1, seed=7, epoch=1) for r in (0, 1)]
    one, two = dali_epoch(data, cfg, single, 1), [dali_epoch(data, cfg, plan, 1) for plan in ranks]
    for k, step in enumerate(single):
        by_id = dict(zip(step.micro[0].tolist(), one[k]))
        union = [(i, x) for r in (0, 1) for i, x in zip(ranks[r][k].micro[0].tolist(), two[r][k])]
        assert sorted(i for i, _ in union) == sorted(by_id) and all(torch.equal(x, by_id[i]) for i, x in union)
    resumed = dali_epoch(data, cfg, single[1:], 1)
    assert len(resumed) == len(single) - 1 and all(torch.equal(a, b) for a, b in zip(one[1:], resumed))


def test_a_pass_left_early_leaves_nothing_in_the_next_and_bigger_batches_fit(tmp_path):
    """An evaluation stopped after its first batch (trainer.limit_eval_batches) left batches inside DALI: the next
    pass gets its own. Evaluation batches larger than the training ones rebuild the pipeline bigger."""
    write_tree(tmp_path / "tree", per_class=(10, 5))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    steps = plan_epoch(len(data.train), 4, 1, 0, 1, seed=7, epoch=0)
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        fresh = [b.x for b in loader.train_batches(steps, 0)]
        next(iter(loader.eval_batches("test", torch.arange(10), 2)))  # 4 more were handed to DALI
        again = [b.x for b in loader.train_batches(steps, 0)]
        (whole, _), *rest = loader.eval_batches("test", torch.arange(10), 10)
    finally:
        loader.close()
    assert len(again) == len(fresh) == 5 and all(torch.equal(a, b) for a, b in zip(fresh, again))
    assert whole.shape == (10, 3, 16, 16) and not rest


def test_batches_are_read_off_the_training_thread_and_close_leaves_no_thread(tmp_path):
    """The files of each batch are read (and its crops drawn) by a thread of the loader's, while the trainer
    steps; the batches are those of a fresh loader. close() stops that thread; the loader still serves after."""
    write_tree(tmp_path / "tree", per_class=(10, 5))
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    steps = plan_epoch(len(data.train), 4, 1, 0, 1, seed=7, epoch=1)
    files, readers = data.train.files, set()
    read = files.read

    def recorded(ids):
        readers.add(threading.current_thread().name)
        return read(ids)

    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        files.read = recorded
        first = [b.x for b in loader.train_batches(steps, 1)]
        loader.close()
        assert not [t for t in threading.enumerate() if t.name.startswith("dali-read")]
        again = [b.x for b in loader.train_batches(steps, 1)]
    finally:
        del files.read
        loader.close()
    assert readers and threading.current_thread().name not in readers
    assert len(first) == 5 and all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(torch.equal(a, b) for a, b in zip(first, dali_epoch(data, cfg, steps, 1)))


@pytest.mark.parametrize("damage", ["header", "truncated"])
def test_an_unreadable_image_is_one_line_naming_it(tmp_path, damage):
    """A file whose header is not an image's is named by ddplab, which reads the headers; one that DALI cannot
    decode past its header is named from DALI's error."""
    write_tree(tmp_path / "tree", per_class=(4, 2))
    bad = tmp_path / "tree/train/b/2.jpg"
    blob = bad.read_bytes()
    bad.write_bytes(b"not an image at all" if damage == "header" else blob[: len(blob) // 2])
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)
    with pytest.raises(ConfigError) as info:
        dali_epoch(data, cfg, steps, 0)
    if damage == "header":
        assert (
            str(info.value)
            == f"{bad}: cannot read this image (not an image format PIL can read); remove or replace the file"
        )
    else:
        assert str(info.value) == (
            f"{bad}: DALI could not decode this image; remove or replace the file (data.decode=cpu reads more "
            "formats and names what is wrong)"
        )


def test_a_pass_after_dali_gave_up_starts_a_new_pipeline(tmp_path):
    """DALI's pipeline is gone after a decoding error, with batches still handed in: a later pass (the evaluation
    of a run that goes on, here of readable test images) builds a new one instead of asking the old."""
    write_tree(tmp_path / "tree", per_class=(4, 2))
    bad = tmp_path / "tree/train/b/2.jpg"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    loader = build_loader(data, cfg.data, CPU, False, seed=7)
    try:
        with pytest.raises(ConfigError, match="DALI could not decode this image"):
            list(loader.train_batches(plan_epoch(len(data.train), 2, 1, 0, 1, seed=7, epoch=0), 0))
        assert loader.dali.pending  # batches after the bad one were handed in
        tests = list(loader.eval_batches("test", torch.arange(4), 2))
    finally:
        loader.close()
    assert [x.shape for x, _ in tests] == [(2, 3, 16, 16)] * 2


def test_a_format_only_the_cpu_path_reads_is_one_line_naming_it(tmp_path):
    """A GIF saved under a .jpg name: decode_cpu reads it, DALI does not; the run says so before DALI sees it."""
    from PIL import Image

    write_tree(tmp_path / "tree", per_class=(4, 2))
    gif = tmp_path / "tree/train/a/1.jpg"
    Image.fromarray(np.zeros((20, 30, 3), dtype=np.uint8)).convert("P").save(gif, "GIF")
    data, cfg = disk_data(tmp_path, tmp_path / "tree", "data.decode=dali")
    steps = plan_epoch(len(data.train), 8, 1, 0, 1, seed=7, epoch=0)
    with pytest.raises(ConfigError) as info:
        dali_epoch(data, cfg, steps, 0)
    formats = "JPEG, PNG, BMP, TIFF, PNM, JPEG 2000, WEBP"
    assert str(info.value) == f"{gif}: not a format DALI decodes ({formats}); use data.decode=cpu"


@pytest.mark.parametrize(
    "option,said",
    [
        ("data.skip_bad_images=true", r"^data.skip_bad_images=true needs ddplab's decoders, .*data.decode=auto"),
        ("data.crop=workers", r"^data.crop=workers needs data.decode=cpu: .*use data.crop=device"),
        ("data.auto_augment=trivial", r"^data.auto_augment=trivial runs in the CPU workers .*data.decode=dali"),
    ],
)
def test_what_dali_cannot_do_is_one_line_before_anything_runs(tmp_path, option, said):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    with pytest.raises(ConfigError, match=said):
        disk_data(tmp_path, tmp_path / "tree", "data.decode=dali", option)


@pytest.mark.usefixtures("one_cpu")
def test_dali_threads_are_the_workers_count_and_one_on_one_cpu(caplog):
    """data.num_workers sets DALI's threads: auto gives this process's CPUs but one, and on one CPU still one thread
    (DALI needs one), as the log line says."""
    caplog.set_level(logging.INFO, logger="src.data.loader_plan")
    options = LoaderOptions(loader="auto", num_workers="auto", decode="dali")
    assert resolve_plan(options, CPU, in_memory=False, encoded=True, trivial=False).workers == 1
    assert [r.getMessage() for r in caplog.records] == [
        "data.num_workers=auto: 1 DALI threads (1 CPUs for this process, one kept for it)"
    ]
    assert resolve_plan(LoaderOptions("auto", 5, "dali"), CPU, False, True, False).workers == 5


def test_the_hardware_jpeg_decoder_is_off_from_six_threads():
    """With 7 or 15 DALI threads per H200 the hardware JPEG decoder cost 12 % of ResNet-50's images/s, with 3 it
    gave 11 % (bench/results/dali-engine_h200_2026-11-29.md): off from 6 threads, DALI's own share below; DALI on
    the CPU has no such decoder."""
    assert [decoder_options(True, n) for n in (1, 3, 5)] == [{}] * 3
    assert [decoder_options(True, n) for n in (6, 7, 15)] == [{"hw_decoder_load": 0.0}] * 3
    assert decoder_options(False, 15) == {}


def test_a_run_with_dali_trains_and_records_it(tmp_path):
    """train.py's loop end to end with data.decode=dali: every image seen, finite numbers, and the loader and its
    thread count in metrics.json's hparams; the same run with data.decode=cpu lands within DALI's rounding."""
    write_tree(tmp_path / "tree", per_class=(12, 4))
    runs = {}
    for decode in ("dali", "cpu"):
        cfg = make_cfg(
            tmp_path / decode,
            "data=imagefolder",
            f"data.root={tmp_path / 'tree'}",
            "data.image_size=16",
            "data.augment=random_resized_crop",
            f"data.decode={decode}",
            "data.num_workers=2",
            "data.batch_size=8",
            "trainer.max_epochs=2",
        )
        runs[decode] = train(cfg), (tmp_path / decode / "run" / "metrics.json").read_text()
    metrics, record = runs["dali"]
    assert metrics["test_count"] == 8 and np.isfinite(metrics["test_loss"])
    assert '"loader": "decode-dali"' in record and '"num_workers": 2' in record
    assert abs(metrics["test_loss"] - runs["cpu"][0]["test_loss"]) < 0.05


@pytest.mark.slow
def test_two_ranks_with_dali_end_where_single_ends(tmp_path):
    """ddp x2 over gloo, each rank with a DALI pipeline of its own: every sample decoded and cropped as on one
    device, so the weights end the same."""
    write_tree(tmp_path / "tree", per_class=(16, 4))
    same = (
        *("data=imagefolder", f"data.root={tmp_path / 'tree'}", "data.image_size=16", "data.val_fraction=0"),
        *("data.augment=random_resized_crop", "data.decode=dali", "data.num_workers=1", "data.batch_size=8"),
        *("model.batch_norm=false", "scheduler=constant", "trainer.max_epochs=1"),
    )
    train(make_cfg(tmp_path / "single", *same))
    launch(make_cfg(tmp_path / "ddp", *same, "strategy=ddp", "trainer.devices=2"))
    single, ddp = (find(tmp_path / k / "run/checkpoints", "last") for k in ("single", "ddp"))
    assert_same_weights(single, ddp)
    assert read_metrics(tmp_path / "ddp/run")["hparams"]["loader"] == "decode-dali"


# --- on CUDA (the GPU machine): DALI's mixed decoder and the hardware JPEG engine ---------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("threads, engine", [(2, "on, at DALI's default share"), (6, "off")])
def test_dali_on_cuda_gives_the_cpu_paths_crops(tmp_path, caplog, threads, engine):
    """With the hardware JPEG decoder on (few threads) and off (many), as the log line says."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    caplog.set_level(logging.INFO, logger="src.data.dali")
    write_tree(tmp_path / "tree", kinds=KINDS, per_class=(10, 5), smooth=True)
    data, cfg = disk_data(tmp_path, tmp_path / "tree", f"data.num_workers={threads}")
    steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=7, epoch=2)

    def run(loader):
        x = [b.x for b in loader.train_batches(steps, 2)]
        assert all(t.device == loader.device and t.dtype == torch.float32 for t in x)
        if loader.device.type == "cuda":
            assert all(t.is_contiguous(memory_format=torch.channels_last) for t in x)
        return [t.cpu() for t in x]

    dali, cpu = dali_and_cpu(data, cfg, run, torch.device("cuda"))
    for x, ref in zip(dali, cpu):  # nvjpeg's IDCT and chroma upsampling: a few levels (as data.decode=gpu)
        assert levels(x, ref, data).mean() < 5
    assert f"DALI: {threads} threads, the GPU's hardware JPEG decoder {engine}" in caplog.messages
