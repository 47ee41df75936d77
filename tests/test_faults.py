"""Mistakes and faults end in the right result or in one line that says what to change — never in a
silently wrong "completed". Each silent case here failed on the code before it was fixed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from src.config.errors import ConfigError
from src.run.launch import main as launch
from src.state.resume import already_completed, reconcile
from tests.conftest import ROOT, read_metrics, run_cli, start_train, start_until_checkpoint, weights


def _one_line_error(proc, message: str) -> None:
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-1500:]
    assert (proc.stdout + proc.stderr).count(message) == 1, proc.stdout[-1500:]  # what a terminal shows: once


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 3-epoch run started from the command line."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli("debug=fast", "trainer.max_epochs=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.max_epochs=4", "trainer.max_epochs=4 (run: 3)"),  # was: new epochs at lr 0
        ("optim.lr=3", "optim.lr=3 (run: 0.1)"),  # was: ignored, yet recorded
        ("data.batch_size=64", "data.batch_size=64 (run: 128)"),  # was: "step 5" of another plan
        ("data.eval_batch_size=8", "data.eval_batch_size=8 (run: "),  # was: re-tested, metrics.json rewritten
        ("trainer.limit_eval_batches=1", "trainer.limit_eval_batches=1 (run: None)"),  # was: rewritten, 8 images
    ],
)
def test_a_completed_run_refuses_options_that_change_its_numbers_and_stays_byte_identical(finished_run, override, key):
    before = _files(finished_run)
    proc = run_cli("debug=fast", override, f"hydra.run.dir={finished_run}")
    _one_line_error(proc, key)
    assert "holds a completed run" in proc.stderr
    assert _files(finished_run) == before


def _files(run_dir: Path) -> dict:
    """Every file of a run dir, by content and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_rerunning_a_completed_run_says_so_and_changes_nothing(finished_run):
    before, metrics = _files(finished_run), read_metrics(finished_run)
    proc = run_cli("debug=fast", f"hydra.run.dir={finished_run}", "trainer.progress_bar=false")  # may change
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "holds a completed run" in proc.stdout and "nothing to do" in proc.stdout, proc.stdout[-2000:]
    assert "resumed" not in proc.stdout + proc.stderr  # was: "resumed ... at epoch 4 step 0", then re-tested
    assert _files(finished_run) == before
    assert f"{metrics['final']['test_top1']:.2f} %" in proc.stdout


def test_resuming_another_run_into_a_completed_run_is_refused(finished_run, tmp_path):
    other = tmp_path / "other"
    assert run_cli("debug=fast", "trainer.max_epochs=1", f"hydra.run.dir={other}").returncode == 0
    before = _files(finished_run)
    proc = run_cli("debug=fast", f"trainer.resume={other}/checkpoints/last.pt", f"hydra.run.dir={finished_run}")
    _one_line_error(proc, "holds a completed run; trainer.resume=")  # was: exit 0, its results replaced
    assert _files(finished_run) == before


def test_reconcile_fills_unset_keys_from_the_checkpoint_and_refuses_set_ones(finished_run, cfg_factory):
    cfg = cfg_factory(f"paths.output_dir={finished_run}")
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.paths.output_dir = str(finished_run)
    assert reconcile(cfg, overrides=[]).trainer.max_epochs == 3
    with pytest.raises(ConfigError, match=r"trainer.max_epochs=2 \(checkpoint: 3\)"):
        reconcile(cfg, overrides=["trainer.max_epochs=2"])
    with pytest.raises(ConfigError, match="trainer.max_epochs"):
        reconcile(cfg, overrides=None)  # a config composed in Python: every difference counts as set


def test_a_resume_naming_the_strategy_takes_the_device_count_from_its_own_defaults(finished_run, cfg_factory, tmp_path):
    state = torch.load(finished_run / "checkpoints/last.pt", weights_only=True)
    state["config"]["strategy"] = {"_target_": "src.strategies.DDP"}
    state["config"]["trainer"]["devices"] = 2  # as if a ddp run on two devices had saved it
    torch.save(state, tmp_path / "ddp.pt")
    cfg = cfg_factory(f"trainer.resume={tmp_path / 'ddp.pt'}")
    kept = reconcile(cfg, overrides=[f"trainer.resume={tmp_path / 'ddp.pt'}"])
    assert kept.trainer.devices == 2 and kept.strategy._target_ == "src.strategies.DDP"  # as it ran
    moved = reconcile(cfg, overrides=["strategy=single", f"trainer.resume={tmp_path / 'ddp.pt'}"])
    assert moved.trainer.devices == cfg.trainer.devices  # was: 2, "strategy=single ... got trainer.devices=2"


def test_resuming_a_finished_checkpoint_into_a_new_dir_tests_its_best_weights(finished_run, tmp_path):
    proc = run_cli("debug=fast", f"trainer.resume={finished_run}/checkpoints/last.pt", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-2000:]  # was: "checkpoint <new dir>/checkpoints/last.pt does not exist"
    assert read_metrics(tmp_path)["final"]["test_top1"] == read_metrics(finished_run)["final"]["test_top1"]


def test_a_checkpoint_written_before_the_package_split_still_resumes(finished_run, tmp_path):
    (tmp_path / "old").mkdir()
    for name in ("last.pt", "best.pt"):  # the final figures are the best epoch's
        state = torch.load(finished_run / "checkpoints" / name, weights_only=True)
        state["config"]["data"]["_target_"] = "src.datasets.load_digits_data"  # where the code lived then
        scheduler = state["config"]["scheduler"]
        scheduler["_target_"] = scheduler["_target_"].replace("src.run.", "src.")
        torch.save(state, tmp_path / "old" / name)
    proc = run_cli("debug=fast", f"trainer.resume={tmp_path / 'old/last.pt'}", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert read_metrics(tmp_path / "run")["final"]["test_top1"] == read_metrics(finished_run)["final"]["test_top1"]


def test_a_group_option_is_not_a_change_of_the_keys_inside_it(finished_run, cfg_factory):
    cfg = cfg_factory()
    with open_dict(cfg):
        cfg.paths.output_dir = str(finished_run)
        cfg.data.eval_batch_size = 8  # as a data.root would differ from another working directory
    metrics = already_completed(cfg, overrides=["data=digits"])  # was: "data.eval_batch_size=8 would change..."
    assert metrics["final"]["test_top1"] == read_metrics(finished_run)["final"]["test_top1"]
    with pytest.raises(ConfigError, match=r"data.eval_batch_size=8 \(run: "):
        already_completed(cfg, overrides=["data.eval_batch_size=8"])
    with open_dict(cfg):
        cfg.data.name = "cifar10"
    with pytest.raises(ConfigError, match=r"data=cifar10 \(run: digits\) would change") as refused:
        already_completed(cfg, overrides=["data=cifar10"])
    assert "eval_batch_size" not in str(refused.value)  # the group's option, not each of its keys


def test_eval_only_writes_eval_json_and_takes_the_model_from_the_checkpoint(finished_run, tmp_path):
    metrics_before = (finished_run / "metrics.json").read_bytes()
    best = finished_run / "checkpoints/best.pt"
    # the model config comes from the checkpoint: it must not need model= restated
    proc = run_cli("train=false", f"ckpt_path={best}", "trainer.device=cpu", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (finished_run / "metrics.json").read_bytes() == metrics_before  # the training run's file is untouched
    ev = json.loads((finished_run / "eval.json").read_text())
    assert ev["status"] == "evaluated" and ev["final"]["test_top1"] == pytest.approx(
        json.loads(metrics_before)["final"]["test_top1"], rel=1e-9
    )
    out = proc.stdout + proc.stderr
    assert "evaluated" in out and "img/s" not in out and "steps/epoch" not in out and "s/epoch" not in out


def test_divergence_stops_with_status_diverged_and_keeps_the_last_good_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("debug=fast", "optim.lr=1e6", "trainer.max_epochs=3", f"hydra.run.dir={run_dir}")
    _one_line_error(proc, "loss is nan in epoch 1; lower optim.lr")
    m = read_metrics(run_dir)
    assert m["status"] == "diverged" and m["final"] == {}
    last = run_dir / "checkpoints/last.pt"
    if last.exists():  # epochs before the divergence were finite
        assert all(torch.isfinite(w).all() for w in weights(last).values() if w.is_floating_point())
    # and TensorBoard's HParams tab shows the run as diverged
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = EventAccumulator(str(run_dir)).Reload().PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["status"].string_value == "diverged"


def test_a_batch_larger_than_the_training_split_is_an_error_before_training(cfg_factory):
    # compiled, the short last batch is dropped: it was 0 steps an epoch; eager, 1 step of every image, logged as
    # the batch asked for
    for compiled in ("true", "false"):
        with pytest.raises(ConfigError, match="is larger than the 1221 training images; set at most 1221"):
            launch(cfg_factory("data.batch_size=100000", f"trainer.compile={compiled}"))


def test_fsdp_keeps_batchnorm_buffers_identical_on_every_rank(cfg_factory, tmp_path):
    final = launch(cfg_factory("strategy=fsdp", "trainer.devices=2", "model.batch_norm=true"))
    assert final["bn_buffers_in_sync"] is True and final["params_in_sync"] is True


# --- bad values: one line each, before any process starts -----------------------------------------

BAD_VALUES = [
    ("trainer.grad_clip=-1", "trainer.grad_clip must be a number > 0 or null"),  # was: gradient ascent
    ("optim.lr=0", "optim.lr must be a number > 0"),
    ("optim.momentum=1.5", "optim.momentum must be a number >= 0 and < 1"),
    ("optim.weight_decay=-0.1", "optim.weight_decay must be a number >= 0"),
    ("optim=adamw optim.betas=[0.9,1.2]", "optim.betas must be a list of a number >= 0 and < 1"),
    ("trainer.label_smoothing=-0.1", "trainer.label_smoothing must be a number >= 0 and < 1"),
    ("trainer.label_smoothing=1", "trainer.label_smoothing must be a number >= 0 and < 1"),
    ("model.width=0", "model.width must be a positive integer"),
    ("scheduler=onecycle scheduler.pct_start=1.5", "scheduler.pct_start must be a number > 0 and < 1"),
    ("scheduler.min_lr_ratio=2", "scheduler.min_lr_ratio must be a number >= 0 and <= 1"),
    ("scheduler.warmup_epochs=-1", "scheduler.warmup_epochs must be a number >= 0"),
    ("trainer.max_restarts=-1", "trainer.max_restarts must be an integer >= 0"),
    ("trainer.threads=0", "trainer.threads must be one of auto or a positive integer"),
    ("trainer.limit_train_batches=0", "trainer.limit_train_batches must be a positive integer or null"),
    ("+trainer.max_epoch=3", "trainer.max_epoch is not an option of trainer"),
    ("+paths.log_dirr=/tmp", "paths.log_dirr is not a paths option; did you mean paths.log_dir?"),  # was: ignored
    ("+data.num_worker=4", "data.num_worker is not a data option; did you mean data.num_workers?"),  # was: ignored
    ("+strategy.bucket_cap_mb=10", "strategy.bucket_cap_mb is not an option of strategy (Single)"),
    ("strategy=ddp strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb must be a number > 0"),
    ("strategy=fsdp strategy.reshard_after_forward=maybe", "strategy.reshard_after_forward must be true or false"),
    ("seed=abc", "seed must be an integer"),
    ("train=maybe", "train must be true or false"),
    # trainer
    ("trainer.max_epochs=0", "trainer.max_epochs must be a positive integer, got 0"),
    ("trainer.max_epochs=1e3", "trainer.max_epochs must be a positive integer, got 1000.0"),  # YAML's float
    ("trainer.devices=0", "trainer.devices must be one of auto or a positive integer, got 0"),
    ("trainer.devices=two", "trainer.devices must be one of auto or a positive integer, got 'two'"),
    ("trainer.device=tpu", "trainer.device must be one of auto, cpu, cuda, got 'tpu'"),
    ("trainer.amp_dtype=fp8", "trainer.amp_dtype must be one of bf16, fp16, got 'fp8'"),
    ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches must be a positive integer, got 0"),
    ("trainer.grad_clip=0", "trainer.grad_clip must be a number > 0 or null, got 0"),
    ("trainer.grad_clip=abc", "trainer.grad_clip must be a number > 0 or null, got 'abc'"),
    ("trainer.resume=123", "trainer.resume must be a string or null, got 123"),
    ("trainer.limit_eval_batches=0", "trainer.limit_eval_batches must be a positive integer or null, got 0"),
    ("trainer.progress_bar=maybe", "trainer.progress_bar must be true or false, got 'maybe'"),
    ("trainer.deterministic=2", "trainer.deterministic must be true or false, got 2"),
    ("trainer.flip_tta=yes", "trainer.flip_tta must be true or false, got 'yes'"),
    ("trainer.compile=null", "trainer.compile must be true or false, got None"),
    ("trainer.threads=many", "trainer.threads must be one of auto or a positive integer, got 'many'"),
    ("trainer.max_restarts=1.5", "trainer.max_restarts must be an integer >= 0, got 1.5"),
    ("trainer.label_smoothing=abc", "trainer.label_smoothing must be a number >= 0 and < 1, got 'abc'"),
    # optimizer and schedule
    ("optim.lr=abc", "optim.lr must be a number > 0, got 'abc'"),
    # a search scored on the test set selects on it (was: train.py returned test_top1 to every sweeper)
    ("objective.metric=test_top1", "objective.metric must be one of val_top1, val_top5, val_loss, got 'test_top1'"),
    ("objective.metric=val_loss", "objective.metric=val_loss would select the worst trial; set objective.direction"),
    ("optim.momentum=-0.1", "optim.momentum must be a number >= 0 and < 1, got -0.1"),
    ("optim.nesterov=maybe", "optim.nesterov must be true or false, got 'maybe'"),
    ("optim.decay_norm_and_bias=1", "optim.decay_norm_and_bias must be true or false, got 1"),
    ("optim=adamw optim.betas=[0.9]", "optim.betas must be two numbers in [0, 1), got [0.9]"),
    ("optim=adamw optim.betas=[0.9,0.99,0.5]", "optim.betas must be two numbers in [0, 1), got [0.9, 0.99, 0.5]"),
    ("+optim.foo=1", "optim.foo is not an option of optim (Optim)"),
    ("scheduler=onecycle scheduler.pct_start=0", "scheduler.pct_start must be a number > 0 and < 1, got 0"),
    ("scheduler.warmup_epochs=abc", "scheduler.warmup_epochs must be a number >= 0, got 'abc'"),
    ("+scheduler.gamma=0.1", "scheduler.gamma is not an option of scheduler"),
    # airbench96's rules (experiment=cifar10_airbench)
    ("optim.norm_lr_scale=0", "optim.norm_lr_scale must be a number > 0, got 0"),
    ("scheduler=onecycle scheduler.end_ratio=1.5", "scheduler.end_ratio must be a number >= 0 and <= 1, got 1.5"),
    ("data.flip=sideways", "data.flip must be one of random, alternate, got 'sideways'"),
    ("model=airbench96 model.widths=[64,0,64]", "model.widths must be a list of a positive integer, got [64, 0, 64]"),
    ("trainer.ema.ramp_power=-1", "trainer.ema.ramp_power must be a number >= 0, got -1"),
    (
        "trainer.ema.copy_back=true",
        "trainer.ema.copy_back=true need a moving average, but trainer.ema.decay=null keeps none",
    ),
    # model, strategy, data, loggers, the top level
    ("model.width=2.5", "model.width must be a positive integer, got 2.5"),
    ("model.batch_norm=maybe", "model.batch_norm must be true or false, got 'maybe'"),
    ("model=resnet18 +model.depth=50", "model.depth is not an option of model (cifar_resnet18)"),
    ("model._target_=src.models.Nope", "model._target_=src.models.Nope cannot be imported"),
    ("strategy=ddp strategy.find_unused_parameters=perhaps", "strategy.find_unused_parameters must be true or false"),
    ("strategy=ddp strategy.static_graph=1", "strategy.static_graph must be true or false, got 1"),
    ("strategy=fsdp strategy.shard_modules=Conv2d", "shard_modules must be one of auto, blocks, root or a list"),
    ("data.batch_size=0", "data.batch_size must be a positive integer, got 0"),
    ("data.batch_size=abc", "data.batch_size must be a positive integer, got 'abc'"),
    ("data.eval_batch_size=0", "data.eval_batch_size must be a positive integer, got 0"),
    ("data.val_fraction=null", "data.val_fraction must be a number >= 0 and < 1, got None"),
    ("+logger.tensorboard.bogus=1", "logger.tensorboard.bogus is not an option of logger.tensorboard"),
    ("seed=1.5", "seed must be an integer >= 0 and <= 4294967295, got 1.5"),
    ("seed=null", "seed must be an integer >= 0 and <= 4294967295, got None"),
    ("seed=1180591620717411303424", "seed must be an integer >= 0 and <= 4294967295"),  # was: an overflow traceback
    ("logger=wandb logger.wandb.mode=bogus", "logger.wandb.mode must be one of offline, online, disabled"),
    ("train=1", "train must be true or false, got 1"),
    ("ckpt_path=5", "ckpt_path must be a string or null, got 5"),
    # the checkpoint policy
    (
        "trainer.early_stopping.patience=-1",
        "trainer.early_stopping.patience must be a positive integer or null, got -1",
    ),
    ("trainer.early_stopping.patience=0", "trainer.early_stopping.patience must be a positive integer or null, got 0"),
    ("trainer.early_stopping.min_delta=-0.1", "trainer.early_stopping.min_delta must be a number >= 0, got -0.1"),
    ("trainer.early_stopping=5", "trainer.early_stopping is a group of options (trainer.early_stopping.patience, "),
    ("+trainer.early_stopping.patiense=2", "trainer.early_stopping.patiense is not an option of trainer.early_stopp"),
    ("trainer.save_top_k=0", "trainer.save_top_k must be a positive integer or null, got 0"),
    ("trainer.save_top_k=-1", "trainer.save_top_k must be a positive integer or null, got -1"),
    ("trainer.checkpoint_every_n_steps=0", "trainer.checkpoint_every_n_steps must be a positive integer or null"),
    # the weights' moving average
    ("trainer.ema.decay=1", "trainer.ema.decay must be a number >= 0 and < 1 or null, got 1"),
    ("trainer.ema.decay=-0.1", "trainer.ema.decay must be a number >= 0 and < 1 or null, got -0.1"),
    ("trainer.ema.every_n_steps=0", "trainer.ema.every_n_steps must be a positive integer, got 0"),
]


@pytest.mark.parametrize("overrides, message", BAD_VALUES)
def test_bad_values_are_one_line_before_anything_runs(cfg_factory, overrides, message):
    from src.run.plan import plan_layout

    with pytest.raises(ConfigError) as info:
        plan_layout(cfg_factory(*overrides.split()))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """The refusals on the command line, started all at once (each is mostly Python start-up): name -> (its
    folder, the finished process)."""
    torchrun = {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}
    cases = {  # name -> (command-line arguments, extra environment)
        **{overrides: ([*overrides.split(), "hydra.run.dir={tmp}/r"], {}) for overrides, _ in CLI_BAD_VALUES},
        "run dir under a file": (["hydra.run.dir={tmp}/file/run"], {}),
        "run dir in /proc": (["hydra.run.dir=/proc/ddplab/run"], {}),
        "sweep dir under a file": (["-m", "seed=1,2", "hydra.sweep.dir={tmp}/file/sweep"], {}),
        "sweep under torchrun": (["-m", "seed=1,2"], torchrun),
    }
    procs = {}
    for i, (name, (args, env)) in enumerate(cases.items()):
        tmp = tmp_path_factory.mktemp(f"cli{i}")
        (tmp / "file").write_text("a file, not a folder")
        procs[name] = (
            tmp,
            subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *(a.format(tmp=tmp) for a in args), "debug=fast"],
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **env},
            ),
        )
    return {name: (tmp, _finished(proc)) for name, (tmp, proc) in procs.items()}


def _finished(proc) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


CLI_BAD_VALUES = [BAD_VALUES[0], BAD_VALUES[14]]


@pytest.mark.parametrize(
    "overrides, message",
    [  # each was a traceback, or (the batch) a run that logged a batch it did not use
        ("optim.lr=${oc.env:DDPLAB_UNSET}", "optim.lr: KeyError raised while resolving interpolation"),
        ("optim.lr=${no.such.key}", "optim.lr: Interpolation key 'no.such.key' not found"),
        ("logger=csv logger.csv.filename=../../x.csv", "logger.csv.filename must be a file name in the run dir"),
        ("logger=wandb logger.wandb.project=a/b", "logger.wandb.project='a/b' is not a W&B project name"),
        ("data.batch_size=1000000000000", "is larger than the 1221 training images; set at most 1221"),
    ],
)
def test_more_mistakes_are_one_line(tmp_path, overrides, message):
    proc = run_cli("debug=fast", *overrides.split(), f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    _one_line_error(proc, message)
    assert not (tmp_path / "run/metrics.json").exists() and not list(tmp_path.rglob("x.csv"))


@pytest.mark.parametrize("overrides, message", CLI_BAD_VALUES)
def test_bad_values_on_the_command_line(cli, overrides, message):
    tmp, proc = cli[overrides]
    _one_line_error(proc, message)
    assert not (tmp / "r/checkpoints").exists() and not (tmp / "r/metrics.json").exists()


def test_a_second_live_run_in_the_same_run_dir_is_refused(tmp_path):
    import signal

    run_dir = tmp_path / "run"
    args = ["debug=fast", "trainer.max_epochs=4", f"hydra.run.dir={run_dir}"]
    first = start_until_checkpoint(*args, run_dir=run_dir)
    first.send_signal(signal.SIGSTOP)  # alive, holding the run dir, but not finishing while the second tries
    try:
        second = run_cli(*args)
    finally:
        first.send_signal(signal.SIGCONT)
    out = first.communicate(timeout=300)[0]
    _one_line_error(second, f"is in use by another live run (pid {first.pid})")
    assert first.returncode == 0, out[-2000:]
    m = read_metrics(run_dir)
    assert m["status"] == "completed" and len(m["epochs"]) == 4


# --- the fault table --------------------------------------------------------------------------------
# Bad inputs and faults, each ending in its exit code (or the ConfigError the CLI prints as one `error:` line, exit
# 2), one line without a traceback, and nothing lost. Besides the cases in this file, these count toward the table:
# tests/data/test_data.py (18 bad data settings, 8 broken image folders and caches), tests/state/test_checkpoint.py
# (a file in the way, a failing pickle, a full disk, a size limit, a truncated file, a live and a killed lock
# holder), tests/models/test_models.py (6: unknown timm and torchvision names, settings ddplab owns),
# tests/run/test_spine.py (19 config combinations, 4 data errors, 4 bad resume checkpoints), tests/run/test_slurm.py
# (3 bad layouts), tests/run/test_sweeps.py (failing sweep points, refused sweeps), tests/state/test_signals.py
# (Ctrl-C, SIGTERM, SIGUSR2 while training).


def _nothing_written(run_dir) -> None:
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "checkpoints").exists()


BAD_LAYOUTS = [  # the cluster presets, checked in the submitting process (src/run/cluster.py)
    (("cluster=slurm", "cluster.nodes=0"), "cluster.nodes and cluster.tasks_per_node must be positive integers"),
    (("cluster=slurm", "cluster.gpus_per_node=null"), "on a CPU-only partition set cluster.tasks_per_node=N"),
    (("cluster=slurm", "cluster.gpus_per_node=2", "trainer.devices=4"), "trainer.devices=4 but each node runs"),
    (("cluster=local_tasks", "cluster.tasks_per_node=1"), "strategy=ddp with 1 rank"),
]


@pytest.mark.parametrize("overrides, message", BAD_LAYOUTS)
def test_bad_cluster_layouts_are_one_line(cfg_factory, overrides, message):
    from src.run.cluster import check_layout

    with pytest.raises(ConfigError) as info:
        check_layout(cfg_factory(*overrides))
    assert message in str(info.value) and "HINT" in str(info.value) and "\n" not in str(info.value)


def _image_tree(root, splits=(("train", "ab"), ("test", "ab")), size=(8, 8)) -> str:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, classes in splits:
        for c in classes:
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(3):
                Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(root / split / c / f"{i}.png")
    return f"data.root={root}"


def _odd_size(root) -> str:
    from PIL import Image

    override = _image_tree(root)
    Image.new("RGB", (12, 9)).save(root / "test/a/odd.png")
    return override


def _empty_class(root) -> str:
    override = _image_tree(root)
    (root / "test/c").mkdir()
    return override


def _a_file(root) -> str:
    root.write_text("not a folder")
    return f"data.root={root}"


BAD_FOLDERS = [  # data=imagefolder: found when the folders are read, before any training
    (_a_file, "data.root: "),
    (lambda root: _image_tree(root, (("train", "ab"),)), "has train/ but neither val/ nor test/"),
    (lambda root: _image_tree(root, (("train", "ab"), ("test", "ac"))), "every split needs the same class folders"),
    (lambda root: _image_tree(root, (("train", "abc"), ("test", "ac"))), "every split needs the same class folders"),
    (_odd_size, "images differ in size"),
    (_empty_class, "class folder(s) c hold no images"),
]


@pytest.mark.parametrize(
    "make, message",
    BAD_FOLDERS,
    ids=[
        "root-is-a-file",
        "no-val-or-test",
        "other-classes-in-test",
        "test-lacks-a-class",
        "two-image-sizes",
        "empty-class",
    ],
)
def test_bad_image_folders_are_one_line(tmp_path, cfg_factory, make, message):
    cfg = cfg_factory("data=imagefolder", make(tmp_path / "data_root"))
    with pytest.raises(ConfigError) as info:
        launch(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    _nothing_written(tmp_path / "run")


def _folder(path) -> str:
    path.mkdir()
    return str(path)


def _bytes(data: bytes):
    def make(path) -> str:
        path.write_bytes(data)
        return str(path)

    return make


BAD_CHECKPOINTS = [  # (key, what is at the path given, message): the file is named, and left as it was
    ("trainer.resume", _folder, "is not a ddplab checkpoint"),
    ("trainer.resume", _bytes(b""), "is unreadable (the file is empty)"),
    ("trainer.resume", _bytes(b'{"model": {}}'), "is unreadable (not a file torch.save wrote"),  # JSON
    ("ckpt_path", _bytes(b"garbage"), "is unreadable (not a file torch.save wrote: neither a zip archive nor"),
    ("ckpt_path", _bytes(b"\x80\x02garbage"), "is unreadable (UnpicklingError"),  # a pickle's start, then not
    ("ckpt_path", str, "does not exist"),  # nothing there
    ("ckpt_path", _folder, "is not a ddplab checkpoint"),
    ("ckpt_path", None, "train=false needs ckpt_path=<checkpoint file>"),
]


@pytest.mark.parametrize(
    "key, make, message",
    BAD_CHECKPOINTS,
    ids=[
        "resume-a-folder",
        "resume-an-empty-file",
        "resume-json",
        "eval-garbage",
        "eval-a-broken-pickle",
        "eval-missing",
        "eval-a-folder",
        "eval-without-checkpoint",
    ],
)
def test_bad_checkpoints_are_one_line_and_left_alone(tmp_path, cfg_factory, key, make, message):
    path = tmp_path / "given.pt"
    given = [f"{key}={make(path)}"] if make else []
    cfg = cfg_factory(*given, *(["train=false"] if key == "ckpt_path" else []))
    before = path.read_bytes() if path.is_file() else None
    with pytest.raises(ConfigError) as info:
        launch(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert (path.read_bytes() if path.is_file() else None) == before
    assert not (tmp_path / "run/metrics.json").exists() and not (tmp_path / "run/eval.json").exists()


def test_a_corrupt_last_checkpoint_in_the_run_dir_is_one_line_and_kept(tmp_path, cfg_factory):
    last = tmp_path / "run/checkpoints/last.pt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"PK\x03\x04 half a zip")  # e.g. a copy cut short
    with pytest.raises(ConfigError, match="last.pt is unreadable") as info:
        launch(cfg_factory())
    assert "\n" not in str(info.value) and last.read_bytes() == b"PK\x03\x04 half a zip"
    # its advice works (it said trainer.resume=none, which is then refused: the dir holds a checkpoint)
    assert str(info.value).endswith(
        "move it out of the run dir to start this run over, or train in another hydra.run.dir"
    )
    assert not (tmp_path / "run/metrics.json").exists()
    last.rename(tmp_path / "kept.pt")
    assert launch(cfg_factory())["test_count"] > 0


# --- filesystem ---------------------------------------------------------------------------------------


def test_a_checkpoint_folder_that_is_a_file_is_one_line_and_no_result(tmp_path, cfg_factory):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/checkpoints").write_text("someone's notes")
    with pytest.raises(ConfigError, match="cannot write checkpoint") as info:
        launch(cfg_factory())
    assert "\n" not in str(info.value) and (tmp_path / "run/checkpoints").read_text() == "someone's notes"
    assert not (tmp_path / "run/metrics.json").exists()


@pytest.mark.parametrize(
    "name, key",
    [
        ("run dir under a file", "hydra.run.dir"),
        ("run dir in /proc", "hydra.run.dir"),
        ("sweep dir under a file", "hydra.sweep.dir"),
    ],
)
def test_an_output_folder_that_cannot_be_made_is_one_line(cli, name, key):
    tmp, proc = cli[name]
    _one_line_error(proc, f"cannot create {key}=")
    assert (tmp / "file").read_text() == "a file, not a folder" and sorted(p.name for p in tmp.iterdir()) == ["file"]


def test_the_default_run_dir_is_checked_without_a_warning(tmp_path):
    """hydra.run.dir's default lies under ${hydra:runtime.cwd}, which Hydra only sets for the job: the check that
    the folder can be made warned on every run ("Callback SweepReport.on_run_start raised ...") and never ran, so
    an output folder that cannot be made ended in Hydra's traceback."""
    ok = run_cli("trainer.max_epochs=1", "logger=none", cwd=tmp_path)
    assert ok.returncode == 0 and "raised" not in ok.stderr, ok.stderr[-1500:]
    made = list((tmp_path / "outputs" / "runs").glob("*/*"))  # one folder: the job's, made by the check
    assert len(made) == 1 and (made[0] / "metrics.json").is_file()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "outputs").write_text("a file, not a folder")
    refused = run_cli("trainer.max_epochs=1", "logger=none", cwd=tmp_path / "elsewhere")
    _one_line_error(refused, f"cannot create hydra.run.dir={tmp_path / 'elsewhere' / 'outputs' / 'runs'}/")
    assert "raised" not in refused.stderr


# --- found by this table (each failed with a traceback or a silently wrong result) -------------------------


@pytest.mark.parametrize(
    "name, kind",
    [
        (".lock", "folder"),  # was: IsADirectoryError (src/state/runlock.py)
        ("metrics.json", "folder"),  # was: IsADirectoryError after training (src/reporting/results.py)
    ],
)
def test_a_file_or_folder_in_the_way_in_the_run_dir_is_one_line(tmp_path, cfg_factory, name, kind):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / name).mkdir() if kind == "folder" else (tmp_path / "run" / name).write_text("x")
    with pytest.raises(ConfigError, match=name) as info:
        launch(cfg_factory())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "name, content",
    [
        ("metrics.json", '{"foo": 1}'),  # was: replaced by the run's
        ("metrics.json", "not json"),
        ("train.log", "my notes\n"),  # was: the run's log appended to it
        ("events.out.tfevents.1.host", "mine"),
        ("checkpoints", None),  # a folder of the user's
    ],
)
def test_files_a_run_did_not_write_under_its_names_are_one_line_and_left_alone(tmp_path, name, content):
    run_dir = tmp_path / "my folder"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / name).mkdir() if content is None else (run_dir / name).write_text(content)
    before = {p.relative_to(run_dir): p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")}
    proc = run_cli("debug=fast", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    _one_line_error(proc, f"hydra.run.dir={run_dir} holds {name}, which no ddplab run wrote there")
    after = {p.relative_to(run_dir): p.read_bytes() if p.is_file() else None for p in run_dir.rglob("*")}
    assert after == before


def test_a_folder_of_other_files_takes_a_run_beside_them(tmp_path):
    """Also the log another rank of the run opened first (torchrun starts the ranks at once; rank 0 refused the
    run when rank 1's train_rank1.log was there before any .hydra)."""
    run_dir = tmp_path / "my folder"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    (run_dir / "train_rank1.log").write_text("")
    proc = run_cli("debug=fast", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run_dir / "notes.txt").read_text() == "mine" and (run_dir / "metrics.json").is_file()


@pytest.mark.parametrize(
    "overrides",
    [
        ("data=synthetic", "data.shape=[3,8]"),  # was: ValueError while unpacking the shape
        ("data=synthetic", "data.num_classes=0"),  # was: RuntimeError from torch.randint
    ],
    ids=["synthetic-2d-shape", "synthetic-0-classes"],
)
def test_impossible_synthetic_data_is_refused(cfg_factory, overrides):
    with pytest.raises(ConfigError, match=overrides[1].split("=")[0]):
        launch(cfg_factory(*overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("data.augment=crop_flip", "data.cutout=100"),
            "data.cutout=100 must be smaller than the images (8x8)",
        ),  # was:
        (("+seeds=3",), "seeds is not an option"),  # blank images, 10 % top-1, "completed"; and ignored
    ],
    ids=["cutout-larger-than-the-images", "misspelt-top-level-key"],
)
def test_impossible_cutout_and_misspelt_top_level_keys_are_refused(cfg_factory, overrides, message):
    with pytest.raises(ConfigError) as info:
        launch(cfg_factory(*overrides))
    assert message in str(info.value)


# --- signals and concurrency ---------------------------------------------------------------------------


def _signal_when(args: list[str], trigger: str, sig: int, pick=None) -> subprocess.CompletedProcess:
    """Run train.py, and once `trigger` is printed send `sig` to it (or to the pid `pick(pid)` chooses)."""
    proc = start_train(*args)
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    out = []
    for line in proc.stdout:
        out.append(line)
        if trigger in line:
            os.kill(pick(proc.pid) if pick else proc.pid, sig)
            break
    out += proc.stdout.readlines()
    watchdog.cancel()
    return subprocess.CompletedProcess(args, proc.wait(), "".join(out), "")


def _a_rank(launcher: int) -> int:
    for child in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError("no rank found")


LONG = ["debug=fast", "trainer.limit_train_batches=null", "data.batch_size=16", "trainer.max_epochs=6"]
DDP = ["strategy=ddp", "trainer.devices=2"]


def _check_signalled(done, run_dir, code: int, said: str) -> None:
    assert done.returncode == code, done.stdout[-3000:]
    assert "Traceback" not in done.stdout and "leaked semaphore" not in done.stdout, done.stdout[-3000:]
    assert len([line for line in done.stdout.splitlines() if said in line]) == 1, done.stdout[-3000:]
    assert not (run_dir / "metrics.json").exists()


def test_sigterm_while_a_run_sets_up_stops_it_at_once_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train(*LONG, f"hydra.run.dir={run_dir}")
    while not (run_dir / ".lock").exists() and proc.poll() is None:  # taken as the run starts to set up
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)  # nothing trained yet: nothing to checkpoint
    done = subprocess.CompletedProcess([], proc.wait(timeout=120), proc.stdout.read(), "")
    _check_signalled(done, run_dir, 143, "stopped by SIGTERM before or after the training steps")
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize(
    "trigger, sig, pick, code, said",
    [
        # Ctrl-C while the ranks start: they hold it until they can act on it, then stop rather than die
        ("starting 2 processes", signal.SIGINT, None, 130, "stopped by SIGINT before or after the training steps"),
        # a rank killed outright: which one, and where its log is
        ("] - epoch 1/", signal.SIGKILL, _a_rank, 1, "error: rank "),
    ],
    ids=["ctrl-c-while-ranks-start", "sigkill-a-rank"],
)
def test_signals_to_ddp_outside_a_checkpoint_are_one_line(tmp_path, trigger, sig, pick, code, said):
    run_dir = tmp_path / "run"
    _check_signalled(_signal_when([*LONG, *DDP, f"hydra.run.dir={run_dir}"], trigger, sig, pick), run_dir, code, said)


def test_a_stale_lock_file_without_a_live_holder_does_not_block(tmp_path, cfg_factory):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/.lock").write_text("999999\n")  # left by a crashed run: the kernel dropped its flock
    assert launch(cfg_factory())["test_count"] > 0


def test_evaluating_a_run_that_is_training_is_allowed_and_touches_none_of_its_files(tmp_path, cfg_factory):
    from src.state.runlock import RunLock

    launch(cfg_factory(sub="a"))
    run_dir = tmp_path / "a/run"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    with RunLock(run_dir):  # as if it were training again
        cfg = cfg_factory("train=false", f"ckpt_path={run_dir}/checkpoints/best.pt", sub="a")
        assert launch(cfg)["test_count"] > 0
    assert {p: p.read_bytes() for p in before} == before and (run_dir / "eval.json").exists()


def test_a_sweep_under_torchrun_is_one_line_before_hydra_and_leaves_nothing(cli):
    tmp, proc = cli["sweep under torchrun"]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = proc.stderr.strip().splitlines()  # was: one line per point, and an empty multirun/ folder left
    assert len(said) == 1 and "under torchrun would run the whole sweep in every rank" in said[0], said
    assert sorted(p.name for p in tmp.iterdir()) == ["file"]


def test_a_hung_test_fails_with_its_stack_instead_of_stopping_the_suite(tmp_path):
    # the project's pytest settings with a 2 s limit: a test stuck past it fails and the next one still runs
    (tmp_path / "test_hang.py").write_text(
        "import time\n\ndef test_stuck():\n    time.sleep(60)\n\ndef test_after():\n    assert True\n"
    )
    start = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(ROOT / "pyproject.toml"),
            "-o",
            "timeout=2",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert time.time() - start < 30
    assert proc.returncode == 1, proc.stdout[-2000:]
    assert "Timeout" in proc.stdout and "1 failed, 1 passed" in proc.stdout, proc.stdout[-2000:]


# --- files a user hands us are data, never code (issue 31) -------------------------------------------------


class _RunsCode:
    """Unpickling this runs a shell command: what a crafted checkpoint would hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _export(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    """`python -m src.run.export <checkpoint> <out>`, as a user runs it."""
    command = [sys.executable, "-m", "src.run.export", str(checkpoint), str(out)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True)


def _crafted_full(path: Path, marker: Path) -> Path:
    torch.save({"model": {}, "config": {}, "epoch": _RunsCode(marker)}, path)
    return path


def _real_sharded(directory: Path) -> Path:
    """A sharded checkpoint as ddplab writes it (DCP tensors + state.pt)."""
    from src.state import checkpoint as ckpt

    state = {"epoch": 1, "step": 0, "config": {}, "strategy": "fsdp", "rng": ckpt.rng_state()}
    ckpt.save_sharded({"model": {"w": torch.ones(3)}, "optimizer": {"lr": 0.5}}, state, directory, ["last"], True)
    return directory / "last"


@pytest.mark.parametrize("how", ["eval", "resume", "run-dir", "export"])
def test_a_crafted_checkpoint_file_is_refused_and_runs_nothing(tmp_path, how):
    marker = tmp_path / "pwned"
    given = _crafted_full(tmp_path / "given.pt", marker)
    run_dir = tmp_path / "run"
    if how == "run-dir":  # the re-run check reads the run dir's own last.pt (a run dir as Hydra leaves it)
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / ".hydra").mkdir()
        given = _crafted_full(run_dir / "checkpoints/last.pt", marker)
    if how == "export":
        proc = _export(given, tmp_path / "out.pt")
    else:
        args = {"eval": ["train=false", f"ckpt_path={given}"], "resume": [f"trainer.resume={given}"]}.get(how, [])
        proc = run_cli("debug=fast", *args, f"hydra.run.dir={run_dir}")
    _one_line_error(proc, "is refused: it asks to load posix.system")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("part", ["state.pt", ".metadata", "bytes"])
def test_a_crafted_sharded_checkpoint_is_refused_and_runs_nothing(tmp_path, part):
    import io
    import pickle

    from src.state import checkpoint as ckpt

    marker = tmp_path / "pwned"
    directory = _real_sharded(tmp_path / "ckpts")
    assert ckpt.load_full(directory)["optimizer"]["lr"] == 0.5  # the real one reads back
    if part == "state.pt":
        _crafted_full(directory / "state.pt", marker)
    elif part == ".metadata":
        (directory / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    else:  # a non-tensor value DCP stores as torch.save bytes, replaced by a payload of the same path
        metadata = ckpt._dcp_parts()[0](directory).read_metadata()
        info = next(info for i, info in metadata.storage_data.items() if i.fqn == "optimizer.lr")
        payload = io.BytesIO()
        torch.save(_RunsCode(marker), payload)
        data = (directory / info.relative_path).read_bytes()
        (directory / info.relative_path).write_bytes(data + payload.getvalue())  # the value now points here
        info.offset, info.length = len(data), len(payload.getvalue())
        with open(directory / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
    readers = {
        "state.pt": (ckpt.load, ckpt.load_full),
        ".metadata": (ckpt.load_full, lambda p: ckpt.saved_shapes(p, {})),
        "bytes": (ckpt.load_full,),
    }
    for read in readers[part]:
        with pytest.raises(ConfigError, match="is refused: it asks to load posix.system") as info:
            read(directory)
        assert "\n" not in str(info.value)
    proc = _export(directory, tmp_path / "out.pt")
    _one_line_error(proc, "is refused")
    assert not marker.exists() and not (tmp_path / "out.pt").exists()


def test_a_killed_checkpoint_writes_leftovers_are_removed_at_the_next_start(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli("debug=fast", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}").returncode == 0
    (run_dir / "metrics.json").unlink()  # as if killed before the end: the next start resumes it
    leftovers = [run_dir / "checkpoints/.last.pt.tmp4242", run_dir / "checkpoints/.best.tmp/__0_0.distcp"]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a checkpoint")
    (run_dir / "notes.tmp").write_text("not a checkpoint's")
    proc = run_cli("debug=fast", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(p.exists() for p in leftovers) and not (run_dir / "checkpoints/.best.tmp").exists()
    assert (run_dir / "notes.tmp").read_text() == "not a checkpoint's"


@pytest.mark.parametrize("damage", ["missing shard", "truncated shard", "truncated metadata"])
def test_a_damaged_sharded_checkpoint_is_one_line(tmp_path, damage):
    from src.state import checkpoint as ckpt

    directory = _real_sharded(tmp_path / "ckpts")
    shard, metadata = directory / "__0_0.distcp", directory / ".metadata"
    if damage == "missing shard":
        shard.unlink()
    else:
        part = shard if damage == "truncated shard" else metadata
        part.write_bytes(part.read_bytes()[:50])
    with pytest.raises(ConfigError, match=f"checkpoint {directory} is unreadable") as info:
        ckpt.load_full(directory)  # what evaluation, fsdp resume and export read (was: DCP's multi-line error)
    assert "\n" not in str(info.value)
    proc = _export(directory, tmp_path / "out.pt")
    _one_line_error(proc, "is unreadable")


@pytest.mark.parametrize(
    "args, message",
    [  # each was Hydra's several lines; its advice for a typo, +key=, would have added the typo as a new key
        (["trainer.max_epoch=3"], "trainer.max_epoch is not an option of trainer; did you mean trainer.max_epochs?"),
        (["-m", "seed=1,2", "trainer.max_epoch=3"], "did you mean trainer.max_epochs?"),
        (["seedd=3"], "seedd is not a top-level option; did you mean seed?"),
        (["data=cifar1000"], "data=cifar1000 is not a data option (cifar10, cifar100, digits, imagefolder, shards"),
        (["data=imagefolder", "data.rooot=x"], "did you mean data.root?"),
        (["model=torchvision", "model.nme=x"], "did you mean model.name?"),
        # the options only: not the arguments the code fills (num_classes, a loader's cfg) nor _target_
        (["model.foo=1"], "model.foo is not an option of model (it has width, batch_norm, weights, freeze); to add"),
        (["hydra.run.dir=/tmp/ünï x"], "cannot read the override 'hydra.run.dir=/tmp/ünï x'"),
        (
            ["-m", "seed=1,2", "--cfg", "job"],
            "--multirun and --cfg ask Hydra for two things at once; keep one",
        ),  # was a
        (["--info", "--multirun"], "--info and --multirun ask Hydra for two things at once"),  # traceback
        (["seed=1,2", "--help"], "--help shows one config, and seed=1,2 is a sweep of several; give it one value"),
        (["--cfg", "job", "seed=1,2"], "--cfg shows one config, and seed=1,2 is a sweep of several"),
        (["seed=1,2"], "seed=1,2 lists several values: add -m to sweep them (python train.py -m ...), or give"),
    ],
)
def test_misspelt_keys_and_options_are_one_line_with_a_suggestion(tmp_path, args, message):
    proc = run_cli("debug=fast", *args, cwd=tmp_path)
    _one_line_error(proc, message)
    assert list(tmp_path.iterdir()) == []  # refused before Hydra made a run or sweep dir


@pytest.mark.parametrize(
    "sweeps",
    [["-m"], ["hydra.mode=MULTIRUN"], ["cluster=local_tasks"], ["cluster=slurm_2nodes"], ["hparams_search=optuna"]],
)
def test_a_sweep_override_is_left_to_hydra_where_the_command_line_sweeps(sweeps):
    from src.config.cli import problem

    assert problem([*sweeps, "seed=1,2"]) is None
    assert problem(["seed=1,2"]).startswith("seed=1,2 lists several values")


def test_a_command_line_refused_before_hydra_answers_without_importing_torch():
    """The line comes in well under a second: torch (~1.5 s of imports) is not loaded to say it."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['train.py', 'trainer.max_epoch=3']\n"
        "try:\n"
        "    runpy.run_path('train.py', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    print(stop.code, 'torch' in sys.modules)\n"
    )
    proc = run_cli(command=[sys.executable, "-c", code])
    assert proc.stdout.split() == ["2", "False"], proc.stdout + proc.stderr[-2000:]
    assert "did you mean trainer.max_epochs?" in proc.stderr


def test_hydra_flags_and_added_keys_are_left_to_hydra(tmp_path):
    helped = run_cli("--help", cwd=tmp_path).stdout
    assert "== Configuration groups ==" in helped
    assert "data: cifar10, cifar100, digits, imagefolder, shards, synthetic\n" in helped  # was: _common listed too
    proc = run_cli("debug=fast", "+model.kwargs.foo=1", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0 and "foo: 1" in proc.stdout, proc.stderr[-2000:]
    proc = run_cli("debug=fast", "data=shards", f"data.root={tmp_path}/none", cwd=tmp_path)  # a ??? key is a key
    _one_line_error(proc, "holds no packed shards")


def test_ddp_evaluation_into_a_run_dir_no_one_made_yet_works(finished_run, cfg_factory, tmp_path):
    # called from Python (no Hydra to make the dir, no training run lock): the ranks are the first to write there;
    # was a FileNotFoundError for .lock.ranks (seen on GPU in tests/test_gpu.py)
    best = finished_run / "checkpoints/best.pt"
    cfg = cfg_factory("train=false", f"ckpt_path={best}", "strategy=ddp", "trainer.devices=2", "model=tiny_cnn")
    assert not (tmp_path / "run").exists()
    assert launch(cfg)["test_count"] > 0
    assert json.loads((tmp_path / "run/eval.json").read_text())["status"] == "evaluated"


def test_a_refused_run_leaves_no_directory_but_keeps_one_it_did_not_make(tmp_path):
    proc = run_cli("debug=fast", "optim.lr=-1", f"hydra.run.dir={tmp_path}/new/run", cwd=tmp_path)
    _one_line_error(proc, "optim.lr must be a number > 0")
    assert list(tmp_path.iterdir()) == []  # was: new/run/.hydra/ and train.log
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    proc = run_cli("debug=fast", "optim.lr=-1", f"hydra.run.dir={mine}", cwd=tmp_path)
    _one_line_error(proc, "optim.lr must be a number > 0")
    assert (mine / "notes.txt").read_text() == "kept"


@pytest.mark.parametrize(
    "key, value",
    [
        ("epoch", "3"),
        ("step", -1),
        ("best_epoch", 1.5),
        ("history", {"epoch": 1}),
        ("history", [{"epoch": 1}, "row"]),
        ("partial_totals", [1.0, 2.0, 3.0]),
        ("crop_on_device", "no"),  # was: taken by its truth value, i.e. True
        ("step", None),  # stands for an entry left out: "its 'step' is absent"
    ],
)
def test_a_checkpoint_whose_progress_is_not_what_train_py_writes_is_refused_in_one_line(
    finished_run, cfg_factory, tmp_path, key, value
):
    state = torch.load(finished_run / "checkpoints/last.pt", weights_only=True)
    state[key] = value
    if value is None:
        del state[key]
    crafted = tmp_path / "crafted.pt"
    torch.save(state, crafted)
    before = crafted.read_bytes()
    for given in ([f"trainer.resume={crafted}"], ["train=false", f"ckpt_path={crafted}"]):  # resume, evaluate
        with pytest.raises(ConfigError) as info:
            launch(cfg_factory("trainer.max_epochs=3", *given))
        message = str(info.value)
        assert "\n" not in message and f"checkpoint {crafted} is refused: its {key!r} is " in message, message
        assert crafted.read_bytes() == before
        assert not (tmp_path / "run/metrics.json").exists() and not (tmp_path / "run/eval.json").exists()
