"""Runs only where CUDA is present (the GPU machine): every strategy trains and evaluates identically."""

from __future__ import annotations

import pytest
import torch

from src.run.launch import main as launch
from src.run.trainer import train
from src.state.checkpoint import find
from tests.conftest import (
    assert_background_checkpoints_equal_inline,
    assert_compiled_loader_augments_like_eager,
    assert_same_weights,
    assert_the_next_seed_reuses_the_compiled_graphs,
    read_metrics,
    run_cli,
    start_until_checkpoint,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU = (
    "trainer.device=cuda",
    "data=synthetic",
    "data.augment=crop_flip",
    "model=resnet18",
    "trainer.amp=true",
    "trainer.channels_last=true",
    "data.batch_size=64",
)


@pytest.mark.parametrize("strategy", ["single", "dp", "ddp", "fsdp"])
def test_strategy_trains_on_gpu(cfg_factory, strategy):
    if strategy != "single" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    devices = [] if strategy == "single" else ["trainer.devices=2"]
    metrics = launch(cfg_factory(*GPU, f"strategy={strategy}", *devices))
    assert metrics["test_count"] == 512 and metrics["params_in_sync"] is True
    assert 0 <= metrics["gpu_data_wait_fraction"] < 1  # from CUDA events (tests/reporting/test_meter.py)
    assert metrics["tflops_per_gpu"] > 0 and 0 < metrics.get("mfu", 0.5) < 1  # MFU where the GPU's peak is known


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_dp_and_ddp_evaluate_like_single(tmp_path, cfg_factory):
    # Exact by construction: real digits trained to a clear margin (a model on random labels has near-tied logits,
    # which any change of summation order flips: 8.98 % vs single on 2 x H100), then evaluated in fp32 without TF32,
    # where the strategies differ only in summation order (~1e-6 of a logit).
    digits = (
        "data=digits",
        "data.augment=none",
        "model=tiny_cnn",
        "trainer.limit_train_batches=null",
        "trainer.max_epochs=10",
    )
    trained = train(cfg_factory(*GPU, *digits, sub="t"))
    assert trained["test_top1"] > 90  # percent: the margin the comparison relies on
    best = f"ckpt_path={tmp_path}/t/run/checkpoints/best.pt"
    fp32 = ("trainer.amp=false", "trainer.deterministic=true")
    results = {
        s: launch(
            cfg_factory(
                *GPU,
                *digits,
                *fp32,
                "train=false",
                best,
                f"strategy={s}",
                *([] if s == "single" else ["trainer.devices=2"]),
                sub=s,
            )
        )
        for s in ("single", "dp", "ddp", "fsdp")
    }
    for s in ("dp", "ddp", "fsdp"):
        assert results[s]["test_count"] == results["single"]["test_count"] == 360
        assert results[s]["test_top1"] == results["single"]["test_top1"], s
        assert results[s]["test_loss"] == pytest.approx(results["single"]["test_loss"], rel=1e-5), s


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "scope, mode, sync",
    [
        ("module", "default", "reducer"),
        ("wrapper", "default", "reducer"),
        ("module", "reduce-overhead", "reducer"),
        ("module", "reduce-overhead", "after_backward"),
    ],
)
def test_compiled_ddp_trains_like_compiled_single(tmp_path, cfg_factory, scope, mode, sync):
    tiny = _tiny_compiled(mode)
    single = launch(cfg_factory(*tiny, sub="single"))
    ddp = launch(
        cfg_factory(
            *tiny,
            "strategy=ddp",
            "trainer.devices=2",
            f"strategy.compile_scope={scope}",
            f"strategy.gradient_sync={sync}",
            sub=f"{scope}-{sync}",
        )
    )
    assert ddp["params_in_sync"] is True and ddp["bn_buffers_in_sync"] is True
    assert ddp["test_count"] == single["test_count"] == 512
    # fp32 without TF32, 6 steps: only summation order differs. The weights are the strong check (on these
    # near-chance data a wrong gradient scale moves the test loss by less than 0.1 %)
    last = [find(tmp_path / sub / "run/checkpoints", "last") for sub in ("single", f"{scope}-{sync}")]
    assert_same_weights(*last, rtol=1e-4, atol=1e-5)
    assert ddp["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_ddp_with_sync_bn_trains_like_compiled_single_with_batchnorm(tmp_path, cfg_factory, mode):
    """sync_bn's all-reduce inside the compiled graph (and, with reduce-overhead, inside its CUDA graphs): two ranks'
    BatchNorm over 32 images each is one device's over 64."""
    tiny = _tiny_compiled(mode, batch_norm=True)
    single = launch(cfg_factory(*tiny, sub="single"))
    ddp = launch(cfg_factory(*tiny, "strategy=ddp", "trainer.devices=2", "strategy.sync_bn=true", sub="ddp"))
    assert ddp["params_in_sync"] is True and ddp["bn_buffers_in_sync"] is True
    last = [find(tmp_path / sub / "run/checkpoints", "last") for sub in ("single", "ddp")]
    assert_same_weights(*last, rtol=1e-4, atol=1e-5)  # BatchNorm's running statistics included
    assert ddp["test_loss"] == pytest.approx(single["test_loss"], rel=1e-4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize(
    "units",
    [
        (),
        ("strategy.collectives=hooks",),
        ("strategy.shard_modules=[features.1]", "strategy.reshard_after_forward=false"),
    ],
    ids=["root-in-graph", "root-hooks", "two-units"],
)
def test_fsdp_under_cuda_graphs_trains_like_compiled_fsdp(tmp_path, cfg_factory, units):
    """The root as the one unit with its collectives inside the graphs (what auto picks) or from FSDP2's hooks, or a
    second unit whose graph reads parameters its own pre-forward gathered."""
    fsdp = ("strategy=fsdp", "trainer.devices=2", "strategy.checkpoint_format=full", "trainer.max_epochs=3", *units)
    modes = ("default", "reduce-overhead")
    # BatchNorm on: its running statistics are the graphs' static inputs too (2 ranks in both runs: the same model)
    runs = {mode: launch(cfg_factory(*_tiny_compiled(mode, batch_norm=True), *fsdp, sub=mode)) for mode in modes}
    assert runs["reduce-overhead"]["test_count"] == runs["default"]["test_count"] == 512
    last = [find(tmp_path / mode / "run/checkpoints", "last") for mode in runs]
    assert_same_weights(*last, rtol=1e-4, atol=1e-5)  # every step replays graphs over gathered parameters
    assert runs["reduce-overhead"]["test_loss"] == pytest.approx(runs["default"]["test_loss"], rel=1e-4)


def _tiny_compiled(mode: str, batch_norm: bool = False) -> tuple[str, ...]:
    return (
        "trainer.device=cuda",
        "data=synthetic",
        "data.augment=crop_flip",
        "model=tiny_cnn",
        "model.width=16",
        # BatchNorm would see 64 images on one device but 32 per rank: another model
        f"model.batch_norm={str(batch_norm).lower()}",
        "data.batch_size=64",
        "trainer.compile=true",
        "trainer.amp=false",
        "trainer.deterministic=true",  # fp32 without TF32
        f"trainer.compile_mode={mode}",
    )


def test_the_next_seed_under_cuda_graphs_reuses_the_compiled_code_and_gets_a_fresh_runs_numbers(cfg_factory):
    # the next run records its CUDA graphs anew for its own tensors, while the last run's pool stays
    graphs = (*GPU, "trainer.compile=true", "trainer.compile_mode=reduce-overhead", "trainer.max_epochs=2")
    reused, fresh = assert_the_next_seed_reuses_the_compiled_graphs(cfg_factory, *graphs)
    assert reused["peak_mem_reserved_gb"] <= 2 * fresh["peak_mem_reserved_gb"]


def test_a_background_write_of_gpu_tensors_saves_them_as_they_were_when_started(tmp_path):
    """The GPU copies the state to host memory in stream order, after the work queued before `start` (here a
    second of it) and before what follows; the writing thread waits for the copy, the training thread does not."""
    from src.state import checkpoint as ckpt

    w = torch.zeros(64, 1024, 1024, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # the GPU is busy for about a second
    w.fill_(1.0)  # queued behind it
    writes = ckpt.BackgroundWrites()
    writes.start({"model": {"w": w}, "epoch": 1}, tmp_path, ["last"])
    w.fill_(7.0)  # the next step changes the tensor before the copy has run
    writes.wait()
    saved = ckpt.load(tmp_path / "last.pt")["model"]["w"]
    assert saved.device.type == "cpu" and torch.equal(saved, torch.ones(64, 1024, 1024))


@pytest.mark.parametrize("compiled", [(), ("trainer.compile=true", "trainer.compile_mode=reduce-overhead")])
def test_gpu_checkpoints_written_in_the_background_equal_those_written_inline(cfg_factory, monkeypatch, compiled):
    """A GPU run takes its checkpoint where the model is (the EMA's swapped in and cloned there) and the GPU copies
    it to pinned host memory while the next epoch trains: bit for bit what writing it in the training thread gives."""
    exact = ("trainer.amp=false", "trainer.deterministic=true", "trainer.ema.decay=0.9", "trainer.save_top_k=2")
    assert_background_checkpoints_equal_inline(cfg_factory, monkeypatch, *GPU, *exact, *compiled)


def test_compiled_gpu_loader_augments_exactly_like_eager_on_gpu(cfg_factory):
    from src.data.datasets import load_data

    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=600").data)
    for pad_mode in ("zeros", "reflect"):
        assert_compiled_loader_augments_like_eager(
            data, torch.device("cuda"), batch=128, seed=5, epoch=2, cutout=8, pad_mode=pad_mode
        )


def test_cpu_cropping_workers_that_starve_the_gpu_hand_it_the_crops(tmp_path):
    """data.crop=auto with data.decode=cpu: one worker cannot feed a tiny model, so the first epoch's probe finds
    the GPU waiting and the crops move to the GPU; a run stopped and resumed keeps that choice, and its result
    names the loader it ended with."""
    import signal

    from tests.data.test_decode import write_tree

    write_tree(tmp_path / "tree", per_class=(64, 8))
    run_dir = tmp_path / "run"
    args = (
        "trainer.device=cuda",
        "model=tiny_cnn",
        "data=imagefolder",
        f"data.root={tmp_path / 'tree'}",
        "data.image_size=32",
        "data.val_fraction=0",
        "data.augment=random_resized_crop",
        "data.decode=cpu",
        "data.num_workers=1",
        "data.batch_size=8",
        "trainer.max_epochs=30",
        f"hydra.run.dir={run_dir}",
    )
    first = start_until_checkpoint(*args, run_dir=run_dir)
    first.send_signal(signal.SIGTERM)
    said = [line for line in first.communicate(timeout=120)[0].splitlines() if "data.crop=auto" in line]
    assert len(said) == 1 and "(at or over 8%): from here on this process crops" in said[0], said
    last = find(run_dir / "checkpoints", "last")
    assert torch.load(last, map_location="cpu", weights_only=True)["crop_on_device"] is True
    resumed = run_cli(*args, "trainer.resume=auto")
    said = [line for line in resumed.stdout.splitlines() + resumed.stderr.splitlines() if "data.crop=auto" in line]
    assert resumed.returncode == 0 and len(said) == 1, resumed.stderr[-2000:]
    assert said[0].endswith("data.crop=auto: this process crops (the workers decode), as measured before the resume")
    assert read_metrics(run_dir)["hparams"]["loader"] == "decode-cpu-crop-device"


def test_profile_loop_counts_the_gpus_busy_time_once():
    """bench/profile_loop.py's busy time lies between the kernels known to run (a sleep of about 0.2 s) and the
    profiled wall time: a GPU-side annotation over the same kernels is not counted again."""
    import sys
    import time

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from profile_loop import device_seconds

    step = torch.compile(lambda a: (a @ a).relu().sum(), mode="reduce-overhead")
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):  # recorded, then replayed
        step(a)
    torch.cuda._sleep(10_000)  # the sleep kernel's first launch loads its module outside the profile
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        with torch.profiler.record_function("the whole region"):
            torch.cuda._sleep(400_000_000)
            for _ in range(20):
                step(a)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spin = [e for e in prof.key_averages() if "spin_kernel" in e.key and e.device_type != torch.autograd.DeviceType.CPU]
    sleep = sum(e.self_device_time_total for e in spin) / 1e6  # torch.cuda._sleep's kernel
    assert 0.05 < sleep <= device_seconds(prof.key_averages()) <= wall
