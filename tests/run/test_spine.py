"""The spine on one process: CLI, default run, exact metrics, checkpoints, resume, data, bad input."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from src.config.errors import ConfigError
from src.data.datasets import load_data
from src.models import build_model
from src.run.between_runs import forget_compiled
from src.run.launch import main as launch
from src.run.trainer import train
from tests.conftest import (
    CIFAR_JPEG_ZIP,
    ROOT,
    assert_compiled_loader_augments_like_eager,
    assert_the_next_seed_reuses_the_compiled_graphs,
    read_metrics,
    run_cli,
    run_cli_meanwhile,
    start_until_checkpoint,
    weights,
)


def test_cli_trains_and_writes_run_dir(tmp_path):
    run_dir = tmp_path / "cli-run"
    proc = run_cli("debug=fast", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "epoch 2/2" in out and "test loss" in out and f"outputs: {run_dir}" in out
    m = read_metrics(run_dir)
    assert m["status"] == "completed" and len(m["epochs"]) == 2
    assert m["final"]["test_count"] == 360  # digits: 20% stratified hold-out of 1,797
    assert m["hparams"]["global_batch"] == 128 and m["hparams"]["per_device_batch"] == 128
    assert m["torch_version"] == torch.__version__ and m["overrides"] == ["debug=fast", f"hydra.run.dir={run_dir}"][:1]
    # the machine, beside its numbers: lscpu and the shell's nproc say the same
    assert (m["device_name"], m["gpu_count"]) == ("cpu", torch.cuda.device_count())
    if "model name" in Path("/proc/cpuinfo").read_text():  # x86 names its model there (ARM does not)
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name:"))
        assert m["cpu_model"] == model
    nproc = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout)
    assert m["cpus_usable"] == nproc and m["cpus"] >= nproc and m["hostname"] == socket.gethostname()
    for name in ("checkpoints/last.pt", "checkpoints/best.pt", ".hydra/config.yaml", "train.log"):
        assert (run_dir / name).is_file(), name
    assert list(run_dir.glob("events.out.tfevents.*"))
    log = (run_dir / "train.log").read_text()
    assert "global batch 128 = 128 per device" in log
    assert (
        "epoch 2/2  train loss" in log
        and "| val loss" in log
        and "| test loss" not in log.split("epoch 2/2")[1].split("\n")[0]
    )


def test_epoch_line_shows_only_the_splits_evaluated(cfg_factory, caplog):
    """Without a validation split no 'val loss nan' is printed; with test_every_epoch the test split is."""
    from src.run.trainer import train

    with caplog.at_level("INFO", logger="ddplab"):
        train(cfg_factory("debug=fast", "data.val_fraction=0", "trainer.test_every_epoch=true", "trainer.max_epochs=1"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 1/1"))
    assert "val loss" not in line and "nan" not in line and "| test loss" in line and "top-1" in line


def test_default_run_reaches_95_percent_on_digits(tmp_path):
    """`python train.py` with no arguments: digits, >= 95 % test top-1 (the CPU budget is checked in the README run)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"paths.root_dir={ROOT}", "trainer.progress_bar=false"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    assert cfg.data.name == "digits" and cfg.trainer.max_epochs == 20
    metrics = train(cfg)
    assert metrics["test_top1"] >= 95.0


@pytest.mark.parametrize("flip_tta,shift", [(False, 0), (True, 0), (True, 1)])
def test_evaluation_is_exact_sum_over_every_sample(tmp_path, cfg_factory, flip_tta, shift):
    cfg = cfg_factory(
        "data.eval_batch_size=7",
        f"trainer.flip_tta={str(flip_tta).lower()}",  # 51 batches + 3
        f"trainer.tta_shift={shift}",
    )
    metrics = train(cfg)
    data = load_data(cfg.data)
    model = build_model(cfg.model, data.num_classes, data.channels)
    model.load_state_dict(weights(tmp_path / "run/checkpoints/best.pt"))
    model.eval()
    mean, std = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
    x = (data.test.images.float() / 255 - mean) / std
    h, w = x.shape[-2:]
    views = [x]
    if shift:  # numpy's reflect padding, cropped at the top-left and bottom-right corners
        padded = torch.from_numpy(np.pad(x.numpy(), ((0, 0), (0, 0), (shift, shift), (shift, shift)), mode="reflect"))
        views += [padded[:, :, :h, :w], padded[:, :, 2 * shift :, 2 * shift :]]
    if flip_tta:  # one image at a time, mirrored by explicit column indexing
        views += [torch.stack([img[:, :, list(range(w - 1, -1, -1))] for img in v]) for v in views]
    with torch.no_grad():
        logits = sum(model(v) for v in views) / len(views)
    y = data.test.labels
    assert metrics["test_count"] == len(y) == 360
    assert metrics["test_loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-5)
    assert metrics["test_top1"] == pytest.approx(100 * (logits.argmax(1) == y).double().mean().item())
    top5 = (logits.topk(5, 1).indices == y[:, None]).any(1).double().mean().item()
    assert metrics["test_top5"] == pytest.approx(100 * top5)


def test_best_checkpoint_is_chosen_on_validation_and_evaluated(tmp_path, cfg_factory):
    metrics = train(cfg_factory("trainer.max_epochs=3"))
    history = read_metrics(tmp_path / "run")["epochs"]
    best = max(history, key=lambda r: r["val_top1"])
    assert metrics["best_epoch"] == best["epoch"]
    assert metrics["val_top1"] == pytest.approx(best["val_top1"])
    state = torch.load(tmp_path / "run/checkpoints/best.pt", weights_only=True)
    assert state["epoch"] == best["epoch"] and {"optimizer", "scheduler", "scaler", "rng"} <= set(state)


def test_eval_only_reproduces_the_final_metrics(tmp_path, cfg_factory):
    trained = train(cfg_factory())
    cfg = cfg_factory("train=false", f"ckpt_path={tmp_path}/run/checkpoints/best.pt", sub="eval")
    evaluated = train(cfg)
    for key in ("test_loss", "test_top1", "test_top5", "val_top1"):
        assert evaluated[key] == pytest.approx(trained[key], rel=1e-6)
    ev = json.loads((tmp_path / "eval/run/eval.json").read_text())
    assert ev["status"] == "evaluated" and ev["final"]["test_top1"] == pytest.approx(trained["test_top1"], rel=1e-6)
    assert not (tmp_path / "eval/run/metrics.json").exists() and ev["epochs"] == []


def test_a_run_leaves_the_process_torch_settings_as_it_found_them(cfg_factory):
    # a local multirun trains its jobs one after another in one process: a deterministic job with one thread
    # must not make the next job deterministic, without TF32 and single-threaded
    def settings():
        tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        return torch.are_deterministic_algorithms_enabled(), *tf32, torch.get_num_threads()

    original = settings()
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_num_threads(2)
    before = settings()
    try:
        train(cfg_factory("trainer.deterministic=true", "trainer.threads=1"))
        assert settings() == before == (False, True, True, 2)
    finally:
        torch.use_deterministic_algorithms(original[0])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = original[1:3]
        torch.set_num_threads(original[3])


@pytest.mark.parametrize("keep_compiled", [False, True])
def test_each_compiled_run_of_another_config_in_one_process_compiles_like_a_fresh_process(cfg_factory, keep_compiled):
    # A local multirun trains its jobs in one process. torch.compile's caches would carry over: once a function
    # has been compiled recompile_limit times (8; 1 here), every later job ran it eagerly, saying nothing.
    from torch._dynamo.utils import counters

    compiled = ("trainer.compile=true", "trainer.max_epochs=1", "trainer.limit_train_batches=2")
    with torch._dynamo.config.patch(recompile_limit=1):
        for batch in (32, 16):  # another shape: a recompilation, were the first job's graphs kept
            before = counters["stats"]["unique_graphs"]
            train(cfg_factory(*compiled, f"data.batch_size={batch}", sub=str(batch)), keep_compiled=keep_compiled)
            assert counters["stats"]["unique_graphs"] > before, f"the job with data.batch_size={batch} ran eagerly"
    forget_compiled()


def test_the_next_seed_in_one_process_reuses_the_compiled_graphs_and_gets_a_fresh_compiles_numbers(cfg_factory):
    compiled = ("trainer.compile=true", "trainer.max_epochs=2", "trainer.limit_train_batches=3")
    assert_the_next_seed_reuses_the_compiled_graphs(cfg_factory, *compiled)


def test_where_a_second_graph_pool_would_not_fit_the_next_seed_compiles_afresh(cfg_factory, monkeypatch):
    from torch._dynamo.utils import counters

    import src.run.between_runs as between_runs

    monkeypatch.setattr(between_runs, "room_for_another_graph_pool", lambda: False)  # as on a nearly full GPU
    compiled = ("trainer.compile=true", "trainer.max_epochs=1", "trainer.limit_train_batches=2")
    train(cfg_factory(*compiled, "seed=1", sub="1"), keep_compiled=True)
    before = counters["stats"]["unique_graphs"]
    train(cfg_factory(*compiled, "seed=2", sub="2"), keep_compiled=True)
    assert counters["stats"]["unique_graphs"] > before, "the seed-2 run reused graphs that had no room to be kept"
    forget_compiled()


def test_accumulation_equals_one_big_batch(tmp_path, cfg_factory):
    common = ("model.batch_norm=false", "scheduler=constant", "trainer.max_epochs=1", "data.batch_size=64")
    train(cfg_factory(*common, sub="a"))
    train(cfg_factory(*common, "trainer.accumulate_grad_batches=4", sub="b"))
    wa, wb = weights(tmp_path / "a/run/checkpoints/last.pt"), weights(tmp_path / "b/run/checkpoints/last.pt")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)


def test_resume_after_sigterm_matches_uninterrupted_run(tmp_path):
    args = [
        "debug=fast",
        "trainer.limit_train_batches=null",
        "trainer.max_epochs=4",
        "trainer.deterministic=true",
        "data.batch_size=32",
    ]
    straight = run_cli_meanwhile(*args, f"hydra.run.dir={tmp_path}/a")
    run_dir = tmp_path / "b"
    proc = start_until_checkpoint(*args, f"hydra.run.dir={run_dir}", run_dir=run_dir)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0 and "saved checkpoints/last.pt" in out, out[-2000:]
    assert not (run_dir / "metrics.json").exists()
    resumed = run_cli(*args, f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr
    straight = straight.result()
    assert straight.returncode == 0, straight.stderr[-2000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run_dir)
    for key in ("test_loss", "test_top1", "test_top5", "best_val_top1"):
        assert b["final"][key] == pytest.approx(a["final"][key], rel=1e-6), key
    assert [r["train_loss"] for r in b["epochs"]] == pytest.approx([r["train_loss"] for r in a["epochs"]], rel=1e-6)


# --- data ---------------------------------------------------------------------------------------


def _write_tree(root: Path, classes=("cat", "dog", "emu"), per_class=(7, 5), size=(12, 10)):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val"), per_class):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                pixels[..., c] = 255  # a class-coloured channel
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")


def test_imagefolder_small_tree(tmp_path, cfg_factory):
    _write_tree(tmp_path / "tree")
    cfg = cfg_factory("data=imagefolder", f"data.root={tmp_path}/tree", "data.batch_size=8", "data.val_fraction=0.2")
    data = load_data(cfg.data)
    assert data.classes == ["cat", "dog", "emu"] and data.image_size == (10, 12) and data.in_memory
    assert len(data.test) == 15 and len(data.train) + len(data.val) == 21 and len(data.val) >= 3
    assert (tmp_path / "tree/.ddplab-cache").is_dir()  # decoded once, cached beside the data
    metrics = train(cfg)
    assert metrics["test_count"] == 15


@pytest.mark.skipif(not CIFAR_JPEG_ZIP.exists(), reason="../shared/datasets/cifar10-jpeg.zip not present")
def test_imagefolder_on_cifar10_jpeg_subset(tmp_path, cfg_factory):
    root = tmp_path / "cifar10-jpeg"
    with zipfile.ZipFile(CIFAR_JPEG_ZIP) as z:
        names = [n for n in z.namelist() if n.endswith(".jpg")]
        picked = [n for n in names if int(Path(n).stem) % 50 == 0]  # ~1,200 of 60,000
        for n in picked:
            target = tmp_path / n
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(n))
    cfg = cfg_factory("data=imagefolder", f"data.root={root}", "data.batch_size=64", "data.num_workers=0")
    data = load_data(cfg.data)
    assert data.num_classes == 10 and data.image_size == (32, 32) and data.augment == "crop_flip"
    metrics = train(cfg)
    assert metrics["test_count"] == len(data.test) > 100


def test_resnet9_shape_and_size():
    from omegaconf import OmegaConf

    model = build_model(OmegaConf.load(ROOT / "conf/model/resnet9.yaml"), num_classes=10, in_channels=3)
    w = 64  # conv weights 3x3 (no bias) + BatchNorm weight and bias per conv, bias-free linear head
    convs = [
        (3, w),
        (w, 2 * w),
        (2 * w, 2 * w),
        (2 * w, 2 * w),
        (2 * w, 4 * w),
        (4 * w, 8 * w),
        (8 * w, 8 * w),
        (8 * w, 8 * w),
    ]
    expected = sum(9 * cin * cout + 2 * cout for cin, cout in convs) + 8 * w * 10
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_synthetic_data_has_configured_shape(cfg_factory):
    data = load_data(cfg_factory("data=synthetic", "data.shape=[3,16,16]", "data.num_classes=7").data)
    assert data.train.images.shape[1:] == (3, 16, 16) and data.num_classes == 7


def test_cifar_missing_without_network_is_a_clear_error(tmp_path, cfg_factory):
    cfg = cfg_factory("data=cifar10", "data.download=false")
    with pytest.raises(ConfigError, match=r"cifar10 is not in .*data/cifar10.*place cifar-10-python.tar.gz"):
        load_data(cfg.data)


@pytest.mark.parametrize("pad_mode,np_mode", [("zeros", "constant"), ("reflect", "reflect")])
def test_crop_flip_matches_a_per_image_reference(pad_mode, np_mode):
    from src.data.augment import crop_flip

    images = torch.randint(0, 256, (5, 3, 6, 7), dtype=torch.uint8)
    params = torch.tensor([[0, 0, 0], [8, 8, 1], [4, 4, 0], [1, 7, 1], [3, 2, 0]])
    out = crop_flip(images, params, pad_mode=pad_mode)
    for img, (oy, ox, flip), got in zip(images, params.tolist(), out):
        ref = torch.from_numpy(np.pad(img.numpy(), ((0, 0), (4, 4), (4, 4)), mode=np_mode))[:, oy : oy + 6, ox : ox + 7]
        assert torch.equal(got, ref.flip(-1) if flip else ref)


def test_cutout_matches_a_per_image_reference():
    from src.data.augment import cutout, draw_params

    x = torch.randn(6, 3, 9, 10)
    centres = torch.tensor([[0, 0], [8, 9], [4, 5], [1, 8], [7, 2], [4, 0]])
    out = cutout(x.clone(), centres, size=4)
    for img, (cy, cx), got in zip(x, centres.tolist(), out):
        ref = img.clone()
        for r in range(9):
            for c in range(10):
                if cy - 2 <= r < cy + 2 and cx - 2 <= c < cx + 2:
                    ref[:, r, c] = 0
        assert torch.equal(got, ref)
    with_cutout, plain = draw_params(50, 1, 2, cutout_within=(9, 10)), draw_params(50, 1, 2)
    assert torch.equal(with_cutout[:, :3], plain)  # cutout draws from its own stream: crops/flips unchanged
    assert with_cutout[:, 3].max() == 8 and with_cutout[:, 4].max() == 9 and with_cutout[:, 3:].min() == 0


@pytest.mark.parametrize("cut,pad_mode", [(0, "zeros"), (5, "zeros"), (0, "reflect")])
def test_resident_and_workers_loaders_yield_identical_batches(cfg_factory, cut, pad_mode):
    from src.data.epoch import plan_epoch
    from tests.conftest import resident_loader, workers_loader

    cfg = cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100")
    data = load_data(cfg.data)
    steps = plan_epoch(len(data.train), 16, 1, 0, 2, seed=3, epoch=1)
    cpu = torch.device("cpu")
    a = list(resident_loader(data, cpu, False, seed=3, cutout=cut, pad_mode=pad_mode).train_batches(steps, 1))
    b = list(
        workers_loader(data, cpu, False, num_workers=2, seed=3, cutout=cut, pad_mode=pad_mode).train_batches(steps, 1)
    )
    assert len(a) == len(b) == 2 * len(steps)
    for x, y in zip(a, b):
        assert torch.equal(x.x, y.x) and torch.equal(x.y, y.y) and x.boundary == y.boundary
    zeros = sum(int((x.x == 0).all(dim=1).sum()) for x in a)  # pixels zero in every channel
    assert zeros > 0 if cut else zeros == 0


@pytest.mark.parametrize("pad_mode", ["zeros", "reflect"])
def test_compiled_gpu_loader_augments_exactly_like_eager(cfg_factory, pad_mode):
    """trainer.compile also compiles the resident loader's augmentation: same pixels, same layout."""
    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    assert_compiled_loader_augments_like_eager(
        data, torch.device("cpu"), batch=16, seed=3, epoch=1, cutout=5, pad_mode=pad_mode
    )


def test_normalize_lookup_equals_the_arithmetic():
    from src.data.augment import normalize, normalize_table

    mean, std = (0.49, 0.48, 0.45), (0.25, 0.24, 0.26)
    images = torch.randint(0, 256, (4, 3, 5, 6), dtype=torch.uint8)
    images[0, :, 0, :3] = torch.tensor([0, 255, 7])  # both ends of the range, and a 7
    reference = (images.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    table = normalize_table(mean, std)
    eager = normalize(images, torch.tensor(mean), torch.tensor(std), table)
    lookup = torch.compile(normalize)(images, torch.tensor(mean), torch.tensor(std), table)
    for out in (eager, lookup):
        assert out.dtype == torch.float32 and torch.equal(out, reference)
    bad = table.clone()
    bad[0, 7] += 1
    assert not torch.equal(torch.compile(normalize)(images, torch.tensor(mean), torch.tensor(std), bad), reference)


def test_gpu_loader_prepared_ahead_yields_the_same_batches(cfg_factory):
    """The next epoch is prepared while the device runs the last one; a stale preparation is never used."""
    from src.data.epoch import plan_epoch
    from tests.conftest import resident_loader

    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    plans = {e: plan_epoch(len(data.train), 16, 1, 0, 1, seed=3, epoch=e) for e in (1, 2)}
    fresh = {
        e: list(resident_loader(data, torch.device("cpu"), False, seed=3).train_batches(plans[e], e)) for e in (1, 2)
    }
    loader = resident_loader(data, torch.device("cpu"), False, seed=3)
    loader.prepare(plans[2], 2)
    stale = list(loader.train_batches(plans[1], 1))  # prepared for epoch 2: epoch 1 must not use it
    loader.prepare(plans[2], 2)
    ahead = list(loader.train_batches(plans[2], 2))
    for got, want in ((stale, fresh[1]), (ahead, fresh[2])):
        assert len(got) == len(want) and all(torch.equal(a.x, b.x) and torch.equal(a.y, b.y) for a, b in zip(got, want))
    assert not torch.equal(fresh[1][0].x, fresh[2][0].x)


def test_each_epoch_is_planned_once(cfg_factory, monkeypatch):
    """The next epoch's plan, made ahead for the loader, is the one that epoch then runs."""
    import inspect

    import src.run.trainer

    plan_epoch, planned = src.run.trainer.plan_epoch, []

    def counting(*args, **kwargs):
        planned.append(inspect.signature(plan_epoch).bind(*args, **kwargs).arguments["epoch"])
        return plan_epoch(*args, **kwargs)

    monkeypatch.setattr(src.run.trainer, "plan_epoch", counting)
    train(cfg_factory("trainer.max_epochs=3"))
    assert planned == [0, 1, 2]


def test_objective_compiled_equals_eager_and_reference():
    from src.run.loss import build_loss_terms

    torch.manual_seed(0)
    logits, y = torch.randn(32, 10), torch.randint(0, 10, (32,))
    logits[0, :] = 0
    logits[0, y[0]] = 1  # one sure hit
    smoothing = 0.2
    logp = logits.log_softmax(1)  # reference: label-smoothed cross-entropy written out
    reference = -((1 - smoothing) * logp.gather(1, y[:, None]).squeeze(1) + smoothing * logp.mean(1)).sum()
    for compiled in (False, True):
        loss, metrics = build_loss_terms(compiled)(logits, y, 0.5, smoothing)
        torch.testing.assert_close(loss, 0.5 * reference)
        assert metrics.dtype == torch.float64 and metrics[1] == (logits.argmax(1) == y).sum()
        torch.testing.assert_close(metrics[0], reference.double())


def test_workers_loader_workers_are_gone_when_train_returns(cfg_factory):
    import multiprocessing

    before = set(multiprocessing.active_children())
    metrics = train(cfg_factory("data.loader=workers", "data.num_workers=2"))
    assert metrics["test_count"] == 360
    assert set(multiprocessing.active_children()) - before == set()


def test_workers_loader_starts_the_next_epoch_during_the_evaluation(cfg_factory):
    """In-memory data with workers: each split has workers of its own, so the next epoch's pass, started by
    prepare(), outlives the evaluation between and gives the batches a fresh loader gives."""
    from src.data.epoch import plan_epoch
    from tests.conftest import workers_loader

    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    plans = {e: plan_epoch(len(data.train), 16, 1, 0, 1, seed=3, epoch=e) for e in (0, 1)}
    fresh = workers_loader(data, torch.device("cpu"), False, 2, seed=3)
    try:
        want = [b.x for b in fresh.train_batches(plans[1], 1)]
    finally:
        fresh.close()
    loader = workers_loader(data, torch.device("cpu"), False, 2, seed=3)
    try:
        list(loader.train_batches(plans[0], 0))
        loader.prepare(plans[1], 1, [("val", torch.arange(len(data.val)), 16)])
        list(loader.eval_batches("val", torch.arange(len(data.val)), 16))
        assert loader.ahead is not None and [s[0] for s in loader.ahead.segments] == ["train"]
        got = [b.x for b in loader.train_batches(plans[1], 1)]
        assert loader.ahead is not None and not loader.ahead.segments  # taken from the prepared pass, not replaced
        assert len(got) == len(want) > 1 and all(torch.equal(a, b) for a, b in zip(got, want))
    finally:
        loader.close()


def test_plan_splits_each_global_batch_across_ranks_and_micro_steps():
    from src.data.epoch import plan_epoch

    single = plan_epoch(103, 20, 1, 0, 1, seed=1, epoch=0)
    ranks = [plan_epoch(103, 20, 2, r, 2, seed=1, epoch=0) for r in range(2)]
    assert [s.global_count for s in single] == [20] * 5 + [3]  # the short last batch is kept (3 >= 1 x 1)
    assert len(ranks[0]) == 5  # ... but not with 2 ranks x 2 micro-steps: 3 < 4 samples
    assert len(plan_epoch(103, 20, 1, 0, 1, seed=1, epoch=0, drop_last=True)) == 5  # compile: full batches only
    for s, (r0, r1) in enumerate(zip(*ranks)):
        union = torch.cat([*r0.micro, *r1.micro])
        assert sorted(union.tolist()) == sorted(single[s].micro[0].tolist())
        assert r0.global_count == len(single[s].micro[0])


# --- bad input: one line, exit 2, nothing written ------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("model=nope", "model=nope is not a model option ("),
        ("data.batch_size=101", "data.batch_size=101 (global) is not divisible"),
        ("trainer.max_epochs=two", "trainer.max_epochs must be a positive integer"),
    ],
)
def test_bad_cli_input_is_one_line_before_anything_runs(tmp_path, override, message):
    proc = run_cli("debug=fast", "strategy=ddp", "trainer.devices=2", override, f"hydra.run.dir={tmp_path}/r")
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r/metrics.json").exists() and not (tmp_path / "r/checkpoints").exists()


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "conf/experiment").glob("*.yaml")))
def test_experiment_presets_compose_and_validate(tmp_path, name):
    from src.run.plan import check_types

    root = ["data.root=/data/imagenet-shards256"] if name == "imagenet_resnet50_a3" else []  # its data.root: ???
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"experiment={name}", f"paths.root_dir={ROOT}", *root])
    check_types(cfg)
    if root:  # the recipes it is named for, where the workers can run TrivialAugment
        d = cfg.data
        assert (d.mixup_alpha, d.cutmix_alpha, d.mix_prob, d.auto_augment, d.decode, d.crop) == (
            0.1,
            1.0,
            1.0,
            "trivial",
            "cpu",
            "workers",
        )
        assert (cfg.trainer.max_epochs, d.batch_size, d.image_size, cfg.trainer.label_smoothing) == (100, 2048, 160, 0)
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            bare = compose("train", overrides=[f"experiment={name}", f"paths.root_dir={ROOT}"])
        with pytest.raises(ConfigError, match=r"^data.root must be set for data=shards, e.g. data.root=...$"):
            check_types(bare)
    if name == "cifar10_long":  # cifar10_94's recipe, changed only where its report says
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            base = compose("train", overrides=["experiment=cifar10_94", f"paths.root_dir={ROOT}"])
        assert cfg.model._target_.endswith("cifar_resnet18") and base.model._target_.endswith("ResNet9")
        assert (cfg.trainer.max_epochs, cfg.data.cutout, cfg.trainer.label_smoothing) == (200, 16, 0.1)
        for key in ("lr", "weight_decay"):
            assert cfg.optim[key] == base.optim[key]
        assert cfg.trainer.tta_shift == base.trainer.tta_shift == 1 and cfg.data.root == base.data.root


def test_config_errors_say_what_to_change(tmp_path, cfg_factory):
    from src.run.plan import plan_layout

    cases = [
        (("trainer.device=cuda",), "no CUDA GPU is visible"),
        (("strategy=dp",), "strategy=dp (nn.DataParallel) needs CUDA GPUs"),
        (("strategy=single", "strategy.sync_bn=true"), "sync_bn=true works only with strategy=ddp"),
        (("strategy=ddp", "trainer.devices=1"), "single process; HINT: set trainer.devices=2"),
        (("strategy=ddp", "trainer.devices=999"), "only 2 CPU core(s) are available"),
        (("data.batch_size=10", "trainer.accumulate_grad_batches=3"), "not divisible"),
        (("trainer.amp=yes",), "trainer.amp must be true or false"),
        (
            ("strategy=ddp", "trainer.devices=2", "strategy.comm_hook=int8"),
            "strategy.comm_hook must be one of none, fp16, bf16",
        ),
        (("data.cutout=-1",), "data.cutout must be an integer >= 0"),
        (("data.cutout=4",), "data.cutout=4 needs data.augment=crop_flip, got 'none'"),
        (("data.pad_mode=mirror",), "data.pad_mode must be one of zeros, reflect, got 'mirror'"),
        (("trainer.tta_shift=-1",), "trainer.tta_shift must be an integer >= 0"),
        (("trainer.compile_mode=fast",), "trainer.compile_mode must be one of default, reduce-overhead"),
        (
            ("strategy=dp", "trainer.devices=2", "trainer.compile_mode=reduce-overhead"),
            "works with strategy=single, ddp or fsdp, not dp",
        ),
        (("strategy=ddp", "trainer.devices=2", "strategy.compile_scope=all"), "strategy.compile_scope must be"),
        (("strategy=ddp", "trainer.devices=2", "strategy.gradient_sync=hooks"), "strategy.gradient_sync must be"),
        (
            ("trainer.compile=true", "trainer.compile_mode=reduce-overhead", "trainer.accumulate_grad_batches=2"),
            "cannot accumulate gradients over trainer.accumulate_grad_batches=2",
        ),
        (("trainer.amp=true", "trainer.amp_dtype=fp16"), "fp16 needs a CUDA GPU"),
    ]
    if torch.cuda.is_available():
        cases = cases[6:-1]  # the CPU-only refusals (and fp16-on-CPU) do not apply
    for overrides, message in cases:
        with pytest.raises(ConfigError) as info:
            plan_layout(cfg_factory(*overrides))
        assert message in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="matches no module"):
        from src.strategies import shard_targets

        shard_targets(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["Conv2d"])


def test_data_errors(tmp_path, cfg_factory):
    from PIL import Image

    from src.data.loaders import build_loader

    # imagefolder's augment=auto becomes random_resized_crop for large images: found when the data is read
    cfg = cfg_factory("data=imagefolder", f"data.root={tmp_path}/big", "data.cutout=4", "data.val_fraction=0")
    for split in ("train", "test"):
        (tmp_path / f"big/{split}/a").mkdir(parents=True)
        Image.new("RGB", (96, 96)).save(tmp_path / f"big/{split}/a/0.png")
    with pytest.raises(ConfigError, match="data.cutout=4 needs data.augment=crop_flip, got 'random_resized_crop'"):
        build_loader(load_data(cfg.data), cfg.data, torch.device("cpu"), False, 0)
    with pytest.raises(ConfigError, match="does not exist"):
        load_data(cfg_factory("data=imagefolder", f"data.root={tmp_path}/missing").data)
    with pytest.raises(ConfigError, match=r"trainer.tta_shift=8 must be smaller than the images \(8x8\)"):
        train(cfg_factory("trainer.tta_shift=8"))
    (tmp_path / "flat/train").mkdir(parents=True)
    (tmp_path / "flat/train/img.png").write_bytes(b"")
    with pytest.raises(ConfigError, match="has no class folders"):
        load_data(cfg_factory("data=imagefolder", f"data.root={tmp_path}/flat").data)


def test_bad_resume_checkpoints(tmp_path, cfg_factory):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="unreadable"):
        launch(cfg_factory(f"trainer.resume={garbage}"))
    with pytest.raises(ConfigError, match="does not exist"):
        launch(cfg_factory(f"trainer.resume={tmp_path}/none.pt"))
    train(cfg_factory(sub="a"))
    mismatched = cfg_factory("model.width=8", f"trainer.resume={tmp_path}/a/run/checkpoints/last.pt", sub="b")
    with pytest.raises(ConfigError, match="does not match this model"):
        train(mismatched)
    with pytest.raises(ConfigError, match="would overwrite it"):
        train(cfg_factory("trainer.resume=none", sub="a"))


def test_two_runs_started_together_never_share_a_directory(tmp_path):
    cmd = [sys.executable, str(ROOT / "train.py"), "debug=fast", "trainer.max_epochs=1", f"paths.log_dir={tmp_path}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    runs = [p for p in (tmp_path / "runs").glob("*/*") if p.is_dir()]
    assert len(runs) == 2 and all((r / "metrics.json").is_file() for r in runs)


def test_no_validation_split_keeps_the_last_epoch_and_tracks_test_every_epoch(tmp_path, cfg_factory):
    metrics = train(cfg_factory("data.val_fraction=0", "trainer.test_every_epoch=true", "trainer.max_epochs=3"))
    saved = read_metrics(tmp_path / "run")
    assert metrics["best_epoch"] == 3 and saved["final"]["val_top1"] is None  # strict JSON: NaN -> null
    assert [r["epoch"] for r in saved["epochs"] if "test_top1" in r] == [1, 2, 3]
    assert saved["epochs"][-1]["test_top1"] == pytest.approx(metrics["test_top1"])
    totals = [r["train_sec_total"] for r in saved["epochs"]]
    assert totals == sorted(totals) and totals[-1] == pytest.approx(sum(r["epoch_sec"] for r in saved["epochs"]))


def test_compiled_loop_trains_like_eager(cfg_factory, tmp_path):
    """trainer.compile compiles the model, the objective and the resident loader's augmentation (here on CPU)."""
    common = (
        "data=synthetic",
        "data.augment=crop_flip",
        "data.loader=resident",
        "data.cutout=4",
        "trainer.label_smoothing=0.1",
        "scheduler=constant",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
    )
    eager = train(cfg_factory(*common, sub="eager"))
    compiled = train(cfg_factory(*common, "trainer.compile=true", sub="compiled"))
    assert compiled["test_count"] == eager["test_count"] > 0
    assert compiled["test_loss"] == pytest.approx(eager["test_loss"], rel=1e-4)
    train_loss = {k: read_metrics(tmp_path / k / "run")["epochs"][0]["train_loss"] for k in ("eager", "compiled")}
    assert train_loss["compiled"] == pytest.approx(train_loss["eager"], rel=1e-4)


def test_ddp_gradient_sync_auto_picks_after_backward_exactly_with_cuda_graphs():
    from src.strategies import DDP

    assert DDP().resolved_gradient_sync(True, "reduce-overhead") == "after_backward"  # the YAML's auto
    for compile_, mode in ((True, "default"), (False, "reduce-overhead"), (True, "max-autotune")):
        assert DDP().resolved_gradient_sync(compile_, mode) == "reducer"
    for explicit in ("reducer", "after_backward"):
        assert DDP(gradient_sync=explicit).resolved_gradient_sync(True, "reduce-overhead") == explicit


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "permuted", "strided_slice"])
def test_flat_gradient_buffer_keeps_each_layout(layout):
    """after_backward's flat buffer holds each gradient in the gradient's own memory order (a plain copy in,
    and the view that becomes the gradient has its strides); a non-dense tensor gets contiguous strides."""
    from src.strategies import _flat_layout_strides

    base = torch.randn(4, 6, 5, 3)
    t = {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last),
        "permuted": base.permute(2, 0, 3, 1),
        "strided_slice": base[:, ::2],
    }[layout]
    flat = torch.zeros(t.numel() + 3)
    view = flat.as_strided(t.shape, _flat_layout_strides(t), 3)
    view.copy_(t)
    assert torch.equal(view, t) and flat[:3].eq(0).all()
    if layout == "strided_slice":
        assert view.is_contiguous()
    else:
        assert view.stride() == t.stride() and torch.equal(flat[3:], t.as_strided((t.numel(),), (1,)))


@pytest.mark.parametrize(
    "asked, deterministic, strategy_keeps_plans, autotune",
    [
        (True, False, True, True),
        (False, False, True, False),  # trainer.cudnn_benchmark=false
        (True, True, True, False),  # deterministic: cuDNN's timed pick may differ run to run
        (True, False, False, False),  # dp: its threads cannot keep the tuned plans
    ],
)
def test_cudnn_autotunes_only_where_asked_and_allowed(asked, deterministic, strategy_keeps_plans, autotune):
    from types import SimpleNamespace

    from src.run.trainer import cudnn_autotune

    t = SimpleNamespace(cudnn_benchmark=asked, deterministic=deterministic)
    assert cudnn_autotune(t, SimpleNamespace(cudnn_benchmark=strategy_keeps_plans)) is autotune
