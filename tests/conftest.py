"""Shared fixtures: compose the real config and shrink it (tiny model, few batches, CPU, tmp dirs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

import src  # noqa: F401  (registers the run-directory resolvers)
from tests.slurm_fixture import slurm_cluster, slurm_env  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
CIFAR_JPEG_ZIP = ROOT.parent / "shared" / "datasets" / "cifar10-jpeg.zip"


def make_cfg(tmp_path: Path, *overrides: str) -> DictConfig:
    """The real config with the test shrink applied, writing into tmp_path."""
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train", overrides=["debug=fast", f"paths.root_dir={ROOT}", f"paths.data_dir={tmp_path}/data", *overrides]
        )
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    return cfg


def run_cli(
    *args: str, cwd: Path = ROOT, timeout: int = 300, env: dict | None = None, command: list[str] | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [*(command or [sys.executable, str(ROOT / "train.py")]), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def run_cli_together(*commands: list[str] | tuple[str, ...], **options) -> list[subprocess.CompletedProcess]:
    """`run_cli(*args, **options)` for each argument list, all at once: independent runs overlap their start-up
    (single-threaded imports, ~3 s each) on the machine's cores."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda args: run_cli(*args, **options), commands))


def run_cli_meanwhile(*args: str, **options) -> Future:
    """`run_cli(*args, **options)` in a thread of its own, e.g. the uninterrupted reference of a run the test stops;
    `.result()` waits for it."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(run_cli, *args, **options)
    pool.shutdown(wait=False)  # the thread ends with the run
    return future


def start_train(*args: str) -> subprocess.Popen:
    """`train.py args` in the background, its output (stdout and stderr, unbuffered) on `proc.stdout`."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def make_env(env: dict | None = None) -> dict:
    """`env` (the environment) for a `make` a test runs: without what the `make test` around it passes down to
    sub-makes (MAKEFLAGS carries its command line's variables, such as ARGS meant for pytest)."""
    inherited = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "ARGS")
    return {k: v for k, v in (os.environ if env is None else env).items() if k not in inherited}


def start_until_checkpoint(*args: str, run_dir: Path, timeout: float = 120) -> subprocess.Popen:
    """Start `train.py args` and return once its first checkpoint exists (it is training, its handlers are set)."""
    proc = start_train(*args)
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints/last.pt").exists() and time.time() < deadline:
        time.sleep(0.02)
    return proc


def read_metrics(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "metrics.json").read_text())


def resident_loader(data, device: torch.device, channels_last: bool, seed: int, compile: bool = False, **augmentation):
    """The dataset in `device` memory, augmented there (data.loader=resident)."""
    from src.data.augment import Augmentation
    from src.data.loaders import ResidentLoader

    return ResidentLoader(data, Augmentation(data, channels_last, device, **augmentation), seed, compile)


def workers_loader(data, device: torch.device, channels_last: bool, num_workers: int, seed: int, **augmentation):
    """In-memory data fetched by `num_workers` DataLoader workers (data.loader=workers)."""
    from src.data.augment import Augmentation
    from src.data.loader_plan import LoaderPlan
    from src.data.loaders import WorkerLoader

    augmented = Augmentation(data, channels_last, device, **augmentation)
    return WorkerLoader(data, LoaderPlan(workers=num_workers), augmented, seed)


def assert_compiled_loader_augments_like_eager(
    data, device: torch.device, batch: int, seed: int, epoch: int, cutout: int, pad_mode: str = "zeros"
) -> None:
    """The resident loader, eager and with its augmentation compiled, yields the eager CPU loader's batches
    (the workers' arithmetic), bit for bit, in channels_last layout."""
    from src.data.epoch import plan_epoch

    steps = plan_epoch(len(data.train), batch, 1, 0, 1, seed=seed, epoch=epoch, drop_last=True)
    cpu = torch.device("cpu")
    options = dict(seed=seed, cutout=cutout, pad_mode=pad_mode)
    reference = list(resident_loader(data, cpu, True, **options).train_batches(steps, epoch))
    eager = list(resident_loader(data, device, True, **options).train_batches(steps, epoch))
    compiled = list(resident_loader(data, device, True, compile=True, **options).train_batches(steps, epoch))
    assert len(reference) == len(eager) == len(compiled) == len(steps) > 1
    for r, e, c in zip(reference, eager, compiled):
        for b in (e, c):
            assert torch.equal(b.x.to(cpu), r.x) and torch.equal(b.y.to(cpu), r.y)
        assert c.x.is_contiguous(memory_format=torch.channels_last) and not c.x.is_contiguous()


def assert_background_checkpoints_equal_inline(cfg_factory, monkeypatch, *overrides: str) -> list[str]:
    """Two runs of `overrides` (4 epochs): one writes its full checkpoints itself, the other from a thread while
    the next epoch trains (src/state/checkpoint.py: BackgroundWrites). They end with the same figures and the same
    checkpoints, bit for bit: epoch, weights, momentum and, where trainer.ema is set, the average. Returns the
    checkpoints' names."""
    from src.run import trainer as trainer_module
    from src.state import checkpoint as ckpt
    from src.state.run_state import Checkpoints

    args = ("trainer.max_epochs=4", *overrides)
    figures, started = [], []
    start = ckpt.BackgroundWrites.start
    monkeypatch.setattr(ckpt.BackgroundWrites, "start", lambda self, *a: started.append(a[2]) or start(self, *a))
    for background in (False, True):
        forced = lambda *a, _on=background, **k: Checkpoints(*a, **{**k, "background": _on})  # noqa: E731
        monkeypatch.setattr(trainer_module, "Checkpoints", forced)
        figures.append(trainer_module.train(cfg_factory(*args, sub=f"background-{background}")))
    assert len(started) == 4 and started[-1][-1] == "last"
    keys = ("test_loss", "val_loss", "best_epoch")
    assert {k: figures[0][k] for k in keys} == {k: figures[1][k] for k in keys}
    dirs = [Path(cfg_factory(sub=f"background-{b}").paths.output_dir) / "checkpoints" for b in (False, True)]
    names = [sorted(p.name for p in d.iterdir()) for d in dirs]
    assert names[0] == names[1] and "last.pt" in names[0]
    for name in names[0]:
        a, b = (torch.load(d / name, weights_only=True) for d in dirs)
        assert a["epoch"] == b["epoch"] and a["best_epoch"] == b["best_epoch"]
        for part in ("model", "ema") if "ema" in a else ("model",):
            assert all(b[part][k].device.type == "cpu" and torch.equal(a[part][k], b[part][k]) for k in a[part])
        momentum = [(a["optimizer"]["state"][k], b["optimizer"]["state"][k]) for k in a["optimizer"]["state"]]
        assert momentum and all(torch.equal(x["momentum_buffer"], y["momentum_buffer"]) for x, y in momentum)
    return names[0]


def assert_the_next_seed_reuses_the_compiled_graphs(cfg_factory, *overrides: str) -> tuple[dict, dict]:
    """Seed 1, then seed 2 in one process, as a local multirun trains them: seed 2 compiles no graph, and its figures
    equal seed 2's compiled afresh. Returns both seed-2 runs' final metrics (reused, fresh)."""
    from torch._dynamo.utils import counters

    from src.run.between_runs import forget_compiled
    from src.run.trainer import train

    train(cfg_factory(*overrides, "seed=1", sub="1"), keep_compiled=True)
    before = counters["stats"]["unique_graphs"]
    reused = train(cfg_factory(*overrides, "seed=2", sub="2"), keep_compiled=True)
    assert counters["stats"]["unique_graphs"] == before, "the seed-2 run compiled its graphs again"
    forget_compiled()
    fresh = train(cfg_factory(*overrides, "seed=2", sub="fresh"))
    assert counters["stats"]["unique_graphs"] > before
    for key in ("test_loss", "test_top1", "val_loss", "val_top1"):
        assert reused[key] == fresh[key], key
    return reused, fresh


def assert_same_weights(a: Path, b: Path, rtol=1e-4, atol=1e-6):
    from src.state.checkpoint import load_full

    wa, wb = load_full(a)["model"], load_full(b)["model"]  # a .pt file or a sharded (fsdp) directory
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k].float(), wb[k].float(), rtol=rtol, atol=atol, msg=k)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.fixture
def cfg_factory(tmp_path):
    return lambda *overrides, sub="": make_cfg(tmp_path / sub if sub else tmp_path, *overrides)


def pytest_collection_modifyitems(items):
    """GPU tests get 240 s each: a hang fails inside one call to a lent GPU machine, with its stacks printed."""
    for item in items:
        if item.get_closest_marker("gpu") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(240))
