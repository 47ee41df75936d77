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
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, read_metrics, run_cli

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
SHORTER = ["trainer.max_epochs=3"]  # stopped once, after the first epoch: the rest is resumed
FOUR = ["trainer.max_epochs=4"]  # stopped three times, each after an epoch ended, then resumed to the end


def _data_workers(pid: int) -> list[int]:
    """The DataLoader worker processes of process `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and (stat.parent / "comm").read_text().strip() == "pt_data_worker":
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return found


def _interrupt(command: list[str], sig: int, group: bool = False, worker: bool = False) -> tuple[int, str]:
    """Start `command`, send `sig` once an epoch has ended (to its whole process group: a terminal's Ctrl-C;
    `worker`: to one of its DataLoader workers)."""
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
            if worker:
                os.kill(_data_workers(proc.pid)[0], sig)
            else:
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
    state = torch.load(run_dir / "checkpoints/last.pt", map_location="cpu", weights_only=True)
    return state["epoch"], state["step"]


def test_ctrl_c_sigterm_and_sigusr2_to_the_ddp_launcher_checkpoint_and_resume_to_the_same_result(tmp_path):
    # the uninterrupted run, alongside: both launchers spend much of their time starting processes
    straight = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *ARGS, *DDP, *FOUR, f"hydra.run.dir={tmp_path}/a"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir = tmp_path / "b"
    command = [sys.executable, str(ROOT / "train.py"), *ARGS, *DDP, *FOUR, f"hydra.run.dir={run_dir}"]
    position = (-1, 0)
    # Ctrl-C in a terminal and `timeout` at its limit signal the whole process group (they used to kill the ranks
    # at once: "rank 0 failed: Signal 15"); SIGUSR2 only the launcher
    for sig, group in ((signal.SIGINT, True), (signal.SIGTERM, True), (signal.SIGUSR2, False)):
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


def _disk_run(tmp_path) -> list[str]:
    """A run whose images are read from disk by 2 DataLoader workers (13 steps per epoch), deterministic."""
    from tests.data.test_decode import write_tree

    write_tree(tmp_path / "tree", per_class=(60, 5))
    return [
        sys.executable,
        str(ROOT / "train.py"),
        *("debug=fast", "trainer.limit_train_batches=null", "data=imagefolder", f"data.root={tmp_path}/tree"),
        *("data.image_size=16", "data.augment=random_resized_crop", "data.decode=cpu", "data.num_workers=2"),
        *("data.batch_size=8", "model=tiny_cnn", "trainer.max_epochs=3", "trainer.deterministic=true"),
    ]


def test_sigterm_to_the_whole_group_with_data_workers_checkpoints_and_resumes_to_the_same_result(tmp_path):
    """SIGTERM to every process of the run (SLURM at a time limit or scancel, `kill -TERM -<pgid>`, `timeout`):
    the DataLoader workers leave it to the training process, which checkpoints; they used to die first, and the
    run ended on "worker exited unexpectedly" with a traceback and no checkpoint. The printed command (which
    names no data or model option) resumes it to the uninterrupted result."""
    command = _disk_run(tmp_path)
    straight = subprocess.run([*command, f"hydra.run.dir={tmp_path}/a"], cwd=ROOT, capture_output=True, text=True)
    assert straight.returncode == 0, straight.stderr[-3000:]
    run_dir = tmp_path / "b"
    code, out = _interrupt([*command, f"hydra.run.dir={run_dir}"], signal.SIGTERM, group=True)
    printed = _check_stopped(code, out, signal.SIGTERM, run_dir)
    resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *printed[2:]], cwd=ROOT, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run_dir)
    assert b["status"] == "completed" and b["config"]["data"] == a["config"]["data"] | {"root": str(tmp_path / "tree")}
    assert b["final"]["test_loss"] == pytest.approx(a["final"]["test_loss"], rel=1e-6)
    assert [r["train_loss"] for r in b["epochs"]] == pytest.approx([r["train_loss"] for r in a["epochs"]], rel=1e-6)


def test_a_killed_data_worker_is_one_line_and_the_run_resumes(tmp_path):
    """A DataLoader worker killed (the host's out-of-memory killer sends SIGKILL): one line that says what to
    lower and how to resume, status data_worker_died in metrics.json; was a traceback."""
    run_dir = tmp_path / "run"
    code, out = _interrupt([*_disk_run(tmp_path), f"hydra.run.dir={run_dir}"], signal.SIGKILL, worker=True)
    assert code == 2 and "Traceback" not in out, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith("error: DataLoader worker (pid"), out[-3000:]  # torch's words
    assert ": a data loading worker died (often the host's out-of-memory killer)" in said[0]
    assert "lower data.num_workers (now 2) or data.batch_size" in said[0]
    assert read_metrics(run_dir)["status"] == "data_worker_died"
    resume = shlex.split(said[0].split("resume with: ", 1)[1])
    assert resume == ["python", "train.py", f"hydra.run.dir={run_dir}"]
    resumed = subprocess.run([sys.executable, str(ROOT / "train.py"), *resume[2:]], cwd=ROOT, capture_output=True)
    assert resumed.returncode == 0 and read_metrics(run_dir)["status"] == "completed", resumed.stderr[-3000:]


def test_ctrl_c_to_a_single_process_checkpoints_mid_epoch(tmp_path):
    run_dir = tmp_path / "run"
    code, out = _interrupt(
        [sys.executable, str(ROOT / "train.py"), *ARGS, f"hydra.run.dir={run_dir}"], signal.SIGINT, group=True
    )
    _check_stopped(code, out, signal.SIGINT, run_dir)
    assert _position(run_dir)[1] > 0


def test_the_printed_resume_command_continues_a_run_of_other_data_and_model_options(tmp_path, cfg_factory):
    """`python train.py hydra.run.dir=<run>` composes the default groups (data: digits, model: small_cnn); a run
    that chose others continues with the checkpoint's groups whole, not a mix of two options' keys (which
    failed with a traceback: data.root missing for shards), and still takes what it may change (workers)."""
    from omegaconf import OmegaConf

    from src.state.resume import reconcile

    first = ["data=synthetic", "data.shape=[3,8,8]", "data.num_samples=300", "model=torchvision", "model.name=resnet18"]
    cfg = cfg_factory(*first)
    saved = OmegaConf.to_container(cfg, resolve=True)
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    torch.save({"model": {}, "config": saved}, tmp_path / "run/checkpoints/last.pt")
    resumed = reconcile(cfg_factory(), overrides=[f"hydra.run.dir={tmp_path}/run"])
    assert OmegaConf.to_container(resumed.data) == saved["data"]
    assert OmegaConf.to_container(resumed.model) == saved["model"]
    workers = reconcile(cfg_factory("data.num_workers=3"), overrides=["data.num_workers=3"])
    assert workers.data.num_workers == 3 and {**OmegaConf.to_container(workers.data), "num_workers": 0} == {
        **saved["data"],
        "num_workers": 0,
    }
    with pytest.raises(Exception, match=r"data.num_samples=200 \(checkpoint: 300\)"):
        reconcile(cfg_factory("data=synthetic", "data.num_samples=200"), overrides=["data.num_samples=200"])


def test_the_printed_resume_command_continues_a_ddp_run_as_ddp(tmp_path, cfg_factory):
    from omegaconf import OmegaConf

    from src.state.resume import reconcile

    cfg = cfg_factory(*ARGS, *DDP)
    (tmp_path / "run/checkpoints").mkdir(parents=True)
    torch.save({"model": {}, "config": OmegaConf.to_container(cfg, resolve=True)}, tmp_path / "run/checkpoints/last.pt")
    again = cfg_factory()  # `python train.py hydra.run.dir=<run>`: nothing else on the command line
    resumed = reconcile(again, overrides=[f"hydra.run.dir={tmp_path}/run"])
    assert resumed.strategy._target_.endswith("DDP") and resumed.trainer.devices == 2, resumed.strategy


@pytest.mark.parametrize("name", ["sp ace;$(touch PWNED) 'q' \"d\"", "a=b,c $HOME ünï\\"])
def test_the_printed_resume_command_is_paste_safe_for_any_run_dir_name(tmp_path, name):
    run_dir = tmp_path / name
    command = [sys.executable, str(ROOT / "train.py"), *ARGS, *SHORTER, f"hydra.run.dir={_quoted(run_dir)}"]
    code, out = _interrupt(command, 2)
    assert code == 128 + 2 and (run_dir / "checkpoints/last.pt").is_file(), out[-3000:]
    said = [line.split("resume with: ", 1)[1] for line in out.splitlines() if "resume with: " in line]
    assert len(said) == 1, out[-3000:]
    # pasted into a shell, as a user would: it runs nothing else and continues this run to completion
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    pasted = subprocess.run(["bash", "-c", said[0]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert pasted.returncode == 0 and read_metrics(run_dir)["status"] == "completed", pasted.stderr[-2000:]
    assert not list(tmp_path.rglob("PWNED")) and not list(ROOT.glob("PWNED"))


def _quoted(path: Path) -> str:
    from src.config.commands import hydra_value

    return hydra_value(path)


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ranks_whose_launcher_is_killed_save_and_exit_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *ARGS, *DDP, *SHORTER, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    for line in proc.stdout:
        if re.search(r"\] - epoch \d+/", line):
            break
    ranks = [pid for pid in _children(proc.pid) if "train" in Path(f"/proc/{pid}/cmdline").read_text()]
    ranks = ranks or _children(proc.pid)
    proc.kill()  # SIGKILL: no handler, no forwarding; the ranks are orphaned
    proc.wait()
    deadline = time.time() + 20  # they save, then exit at once (they used to wait 60 s for the dead launcher)
    while any(_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.2)
    assert ranks and not any(_alive(pid) for pid in ranks), "ranks outlived their launcher"  # was: a futex wait
    epoch, step = _position(run_dir)
    assert epoch == 1 and step > 0 and not (run_dir / "metrics.json").exists()  # saved mid-epoch on their way out
    resumed = run_cli(f"hydra.run.dir={run_dir}", timeout=300)
    assert resumed.returncode == 0 and read_metrics(run_dir)["status"] == "completed", resumed.stderr[-2000:]


def test_a_stop_during_the_last_epochs_validation_saves_and_exits_instead_of_completing(tmp_path):
    run_dir = tmp_path / "run"
    args = ["debug=fast", "data=synthetic", "data.num_samples=8000", "data.val_fraction=0.99", "data.num_test=64"]
    args += ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "data.batch_size=16", f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:  # two training steps (~0.2 s), then 6-10 s of validation: the signal lands in it
        lines.append(line)
        if "steps/epoch" in line:
            threading.Timer(2.5, proc.send_signal, (signal.SIGINT,)).start()
    out = "".join(lines)
    assert proc.wait() == 130, out[-3000:]  # was: ignored, exit 0 "completed" after the final test
    assert "at the end of epoch 1; resume with: python train.py" in out and "Traceback" not in out, out[-3000:]
    assert not (run_dir / "metrics.json").exists() and _position(run_dir) == (1, 0)
    resumed = run_cli(f"hydra.run.dir={run_dir}", timeout=300)
    assert resumed.returncode == 0 and read_metrics(run_dir)["status"] == "completed", resumed.stderr[-2000:]


def test_a_stop_forwarded_after_a_ranks_run_returned_does_not_kill_it(tmp_path):
    """The launcher forwards a stop as its carrier; one that reaches a rank after its run has returned (its
    result on the way back) once killed it by the carrier's default action, and the launcher then reported a
    completed run as "rank 0 failed: Signal 49". The rank now ignores it and the launcher says the run completed."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    proc = run_cli("-m", "tests.state.stop_after_run", str(tmp_path), command=[sys.executable], env=env)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "survived", proc.stderr[-3000:]
    assert (tmp_path / "run/metrics.json").is_file()
