"""Mistakes and faults end in the right result or in one line that says what to change — never in a
silently wrong "completed". Each silent case here failed on the code before it was fixed."""
from __future__ import annotations

import json

import pytest
import torch

from src.config import ConfigError
from src.launch import main as launch
from src.resume import reconcile
from tests.conftest import read_metrics, run_cli, weights


def _one_line_error(proc, message: str) -> None:
    assert proc.returncode == 2, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-1500:]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 3-epoch run started from the command line."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    proc = run_cli("debug=fast", "trainer.max_epochs=3", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


@pytest.mark.parametrize("override, key", [
    ("trainer.max_epochs=4", "trainer.max_epochs=4 (checkpoint: 3)"),   # was: new epochs at lr 0
    ("optim.lr=3", "optim.lr=3 (checkpoint: 0.1)"),                      # was: ignored, yet recorded
    ("data.batch_size=64", "data.batch_size=64 (checkpoint: 128)"),     # was: "step 5" of another plan
])
def test_resume_refuses_options_that_change_the_result(finished_run, override, key):
    before = (finished_run / "metrics.json").read_bytes(), (finished_run / "checkpoints/last.pt").read_bytes()
    proc = run_cli("debug=fast", override, f"hydra.run.dir={finished_run}")
    _one_line_error(proc, key)
    assert "trained with other settings" in proc.stderr
    after = (finished_run / "metrics.json").read_bytes(), (finished_run / "checkpoints/last.pt").read_bytes()
    assert before == after


def test_rerun_without_the_original_overrides_continues_with_the_saved_config(finished_run):
    before = read_metrics(finished_run)
    proc = run_cli("debug=fast", f"hydra.run.dir={finished_run}", "trainer.progress_bar=false")  # may change
    assert proc.returncode == 0, proc.stderr[-2000:]
    after = read_metrics(finished_run)
    assert after["config"]["trainer"]["max_epochs"] == 3  # was: 2, the default, with 3 epochs of history
    assert [r["train_loss"] for r in after["epochs"]] == [r["train_loss"] for r in before["epochs"]]
    assert after["final"]["test_top1"] == before["final"]["test_top1"]


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


def test_eval_only_writes_eval_json_and_takes_the_model_from_the_checkpoint(finished_run, tmp_path):
    metrics_before = (finished_run / "metrics.json").read_bytes()
    best = finished_run / "checkpoints/best.pt"
    # default model is small_cnn; the checkpoint holds tiny_cnn (debug=fast): it must not need model= restated
    proc = run_cli("train=false", f"ckpt_path={best}", "trainer.device=cpu", f"hydra.run.dir={finished_run}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (finished_run / "metrics.json").read_bytes() == metrics_before  # the training run's file is untouched
    ev = json.loads((finished_run / "eval.json").read_text())
    assert ev["status"] == "evaluated" and ev["final"]["test_top1"] == pytest.approx(
        json.loads(metrics_before)["final"]["test_top1"], rel=1e-9)
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


def test_zero_steps_per_epoch_is_an_error_before_training(cfg_factory):
    with pytest.raises(ConfigError, match="leaves 0 training steps per epoch"):
        launch(cfg_factory("data.batch_size=100000", "trainer.compile=true"))


def test_fsdp_keeps_batchnorm_buffers_identical_on_every_rank(cfg_factory, tmp_path):
    final = launch(cfg_factory("strategy=fsdp", "trainer.devices=2", "model.batch_norm=true"))
    assert final["bn_buffers_in_sync"] is True and final["params_in_sync"] is True


# --- bad values: one line each, before any process starts -----------------------------------------

BAD_VALUES = [
    ("trainer.grad_clip=-1", "trainer.grad_clip must be a number > 0 or null"),   # was: gradient ascent
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
    ("+strategy.bucket_cap_mb=10", "strategy.bucket_cap_mb is not an option of strategy (Single)"),
    ("strategy=ddp strategy.bucket_cap_mb=0", "strategy.bucket_cap_mb must be a number > 0"),
    ("strategy=fsdp strategy.reshard_after_forward=maybe", "strategy.reshard_after_forward must be true or false"),
    ("seed=abc", "seed must be an integer"),
    ("train=maybe", "train must be true or false"),
]


@pytest.mark.parametrize("overrides, message", BAD_VALUES)
def test_bad_values_are_one_line_before_anything_runs(cfg_factory, overrides, message):
    from src.config import plan_layout

    with pytest.raises(ConfigError) as info:
        plan_layout(cfg_factory(*overrides.split()))
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [BAD_VALUES[0], BAD_VALUES[14]])
def test_bad_values_on_the_command_line(tmp_path, overrides, message):
    proc = run_cli("debug=fast", *overrides.split(), f"hydra.run.dir={tmp_path}/r")
    _one_line_error(proc, message)
    assert not (tmp_path / "r/checkpoints").exists() and not (tmp_path / "r/metrics.json").exists()


def test_a_second_live_run_in_the_same_run_dir_is_refused(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    run_dir = tmp_path / "run"
    args = ["debug=fast", "trainer.max_epochs=4", f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints/last.pt").exists() and time.time() < deadline:
        time.sleep(0.02)
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
