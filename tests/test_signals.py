"""Stop signals as a local user sends them: every rank saves a mid-epoch checkpoint, one line says where and how to
resume, the process exits 128 + the signal (no traceback, no leaked-semaphore warning), and the printed command
resumes to the same result as an uninterrupted run."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import pytest
import torch

from tests.conftest import ROOT, read_metrics

pytestmark = pytest.mark.slow

# ~77 steps per epoch, deterministic (reruns agree exactly); a signal sent when an epoch ends lands in the next
ARGS = [
    "debug=fast",
    "trainer.limit_train_batches=null",
    "data.batch_size=16",
    "trainer.max_epochs=6",
    "trainer.deterministic=true",
]
DDP = ["strategy=ddp", "trainer.devices=2"]


def _interrupt(command: list[str], sig: int, group: bool = False) -> tuple[int, str]:
    """Start `command`, send `sig` once an epoch has ended (to its whole process group: a terminal's Ctrl-C)."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.search(r"\] - epoch \d+/", line):  # rank 0's line at the end of an epoch: training goes on
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            break
    lines += proc.stdout.readlines()
    watchdog.cancel()
    return proc.wait(), "".join(lines)


def _check_stopped(code: int, out: str, sig: int, run_dir) -> list[str]:
    """The exit code, the one line and the checkpoint; returns the printed resume command."""
    assert code == 128 + sig, out[-3000:]
    assert "Traceback" not in out and "leaked semaphore" not in out, out[-3000:]
    said = [line for line in out.splitlines() if "resume with:" in line]
    assert len(said) == 1 and f"saved checkpoints/last.pt in {run_dir}" in said[0], out[-3000:]
    assert not (run_dir / "metrics.json").exists()  # nothing passed off as a result
    printed = shlex.split(said[0].split("resume with: ", 1)[1])
    assert printed[:2] == ["python", "train.py"] and f"hydra.run.dir={run_dir}" in printed, printed
    return printed


def _position(run_dir) -> tuple[int, int]:
    state = torch.load(run_dir / "checkpoints/last.pt", map_location="cpu", weights_only=False)
    return state["epoch"], state["step"]


def test_ctrl_c_sigterm_and_sigusr2_to_the_ddp_launcher_checkpoint_and_resume_to_the_same_result(tmp_path):
    # the uninterrupted run, alongside: both launchers spend much of their time starting processes
    straight = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *ARGS, *DDP, f"hydra.run.dir={tmp_path}/a"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "b"
    command = [sys.executable, str(ROOT / "train.py"), *ARGS, *DDP, f"hydra.run.dir={run_dir}"]
    position = (-1, 0)
    # Ctrl-C in a terminal reaches the launcher and the ranks at once; SIGTERM and SIGUSR2 only the launcher
    for sig, group in ((signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGUSR2, False)):
        code, out = _interrupt(command, sig, group)
        printed = _check_stopped(code, out, sig, run_dir)
        now = _position(run_dir)
        assert now[1] > 0 and now > position, (sig, now, position)  # mid-epoch, and further than before
        position = now
        # the printed command, started as the user would: it continues the ddp run as ddp
        command = [sys.executable, str(ROOT / "train.py"), *printed[2:]]
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]
    assert straight.wait(timeout=180) == 0, straight.stderr.read()[-3000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run_dir)
    assert b["status"] == "completed" and b["hparams"]["world_size"] == 2
    for key in ("test_loss", "test_top1", "test_top5", "best_val_top1"):
        assert b["final"][key] == pytest.approx(a["final"][key], rel=1e-6), key
    assert [r["train_loss"] for r in b["epochs"]] == pytest.approx([r["train_loss"] for r in a["epochs"]], rel=1e-6)


def test_ctrl_c_to_a_single_process_checkpoints_mid_epoch(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _interrupt(
        [sys.executable, str(ROOT / "train.py"), *ARGS, f"hydra.run.dir={run_dir}"], signal.SIGINT, group=True
    )
    _check_stopped(code, out, signal.SIGINT, run_dir)
    assert _position(run_dir)[1] > 0


def test_the_printed_resume_command_continues_a_ddp_run_as_ddp(tmp_path, cfg_factory):
    from omegaconf import OmegaConf

    from src.resume import reconcile

    cfg = cfg_factory(*ARGS, *DDP)
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    torch.save({"model": {}, "config": OmegaConf.to_container(cfg, resolve=True)}, tmp_path / "run/checkpoints/last.pt")
    again = cfg_factory()  # `python train.py hydra.run.dir=<run>`: nothing else on the command line
    resumed = reconcile(again, overrides=[f"hydra.run.dir={tmp_path}/run"])
    assert resumed.strategy._target_.endswith("DDP") and resumed.trainer.devices == 2, resumed.strategy
