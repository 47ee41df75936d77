"""Checkpoint writes that fail for real (src/state/checkpoint.py): no temp file is left, the previous checkpoint
stays intact and loadable, and a disk problem is a one-line ConfigError naming the file and the cause.

Tests run as root, so a read-only directory would not fail; the failures used here fail for root too:
a directory path under a regular file (ENOTDIR), /dev/full (ENOSPC), a file-size limit (EFBIG, in a
subprocess so the limit does not outlive the test) and an object that cannot be pickled.

Also the run-directory lock (src/state/runlock.py) that keeps a second live run from writing the same checkpoints:
a live holder in another process blocks with its pid named, a SIGKILLed one does not.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from src.config.errors import ConfigError
from src.state import checkpoint as ckpt
from src.state.runlock import RunLock
from tests.conftest import ROOT


def big_state(value: float) -> dict:
    return {"model": {"w": torch.full((200_000,), value)}, "epoch": int(value)}


def assert_previous_intact(ckpt_dir, value: float) -> None:
    assert [p.name for p in ckpt_dir.iterdir()] == ["last.pt"]  # no .last.pt.tmp<pid> left behind
    state = ckpt.load(ckpt_dir / "last.pt")
    assert state["epoch"] == int(value) and torch.equal(state["model"]["w"], big_state(value)["model"]["w"])


def test_save_then_load_roundtrip(tmp_path):
    ckpt.save_atomic(big_state(1.0), tmp_path / "ckpt" / "last.pt")  # creates the directory
    ckpt.save_atomic(big_state(2.0), tmp_path / "ckpt" / "last.pt")  # replaces the file
    assert_previous_intact(tmp_path / "ckpt", 2.0)


def test_names_saved_together_are_written_once_and_a_later_save_leaves_the_others_as_they_were(tmp_path):
    """best.pt and last.pt of one epoch: one file under two names (a second write of a 150 MB checkpoint took as
    long as airbench96's epoch); the next epoch's last.pt replaces its own name only."""
    ckpt.save_full(big_state(1.0), tmp_path, ["best", "last"])
    best, last = tmp_path / "best.pt", tmp_path / "last.pt"
    assert best.stat().st_ino == last.stat().st_ino
    ckpt.save_full(big_state(2.0), tmp_path, ["last"])
    assert ckpt.load(best)["epoch"] == 1 and ckpt.load(last)["epoch"] == 2
    ckpt.save_full(big_state(3.0), tmp_path, ["best", "last"])
    assert [ckpt.load(p)["epoch"] for p in (best, last)] == [3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]  # no temp name left


def test_without_hard_links_the_other_names_are_copies(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.os, "link", lambda src, dst: (_ for _ in ()).throw(PermissionError(1, "no links")))
    ckpt.save_full(big_state(1.0), tmp_path, ["best", "last"])
    best, last = tmp_path / "best.pt", tmp_path / "last.pt"
    assert best.stat().st_ino != last.stat().st_ino and best.read_bytes() == last.read_bytes()
    ckpt.save_full(big_state(2.0), tmp_path, ["last"])
    assert ckpt.load(best)["epoch"] == 1 and ckpt.load(last)["epoch"] == 2


def test_a_background_write_saves_the_state_as_it_was_when_started(tmp_path):
    writes = ckpt.BackgroundWrites()
    state = big_state(1.0)
    writes.start(state, tmp_path, ["best", "last"])
    state["model"]["w"].fill_(7.0)  # the next training steps change the tensors while the thread writes
    state["epoch"] = 7
    writes.wait()
    for name in ("best", "last"):
        saved = ckpt.load(tmp_path / f"{name}.pt")
        assert saved["epoch"] == 1 and torch.equal(saved["model"]["w"], big_state(1.0)["model"]["w"])


def test_a_background_write_that_fails_raises_its_one_line_error_when_waited_for(tmp_path):
    ckpt.save_atomic(big_state(1.0), tmp_path / "last.pt")
    (tmp_path / f".last.pt.tmp{os.getpid()}").symlink_to("/dev/full")  # the temp name save_atomic picks
    writes = ckpt.BackgroundWrites()
    writes.start(big_state(2.0), tmp_path, ["last"])
    with pytest.raises(ConfigError, match=r"^cannot write checkpoint .*last.pt: No space left on device; free space"):
        writes.wait()
    writes.wait()  # raised once
    assert_previous_intact(tmp_path, 1.0)


def test_directory_under_a_file_is_a_one_line_error(tmp_path):
    (tmp_path / "plain_file").write_text("not a directory")
    path = tmp_path / "plain_file" / "checkpoints" / "last.pt"
    with pytest.raises(ConfigError) as err:
        ckpt.save_atomic(big_state(1.0), path)
    assert str(err.value) == (
        f"cannot write checkpoint {path}: Not a directory; free space or set hydra.run.dir elsewhere"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["plain_file"]


def test_unpicklable_object_mid_write_leaves_previous_checkpoint(tmp_path):
    ckpt.save_atomic(big_state(1.0), tmp_path / "last.pt")
    bad = {**big_state(2.0), "hook": lambda: None}  # pickling fails after the zip header is written
    with pytest.raises(Exception, match="pickle") as err:
        ckpt.save_atomic(bad, tmp_path / "last.pt")
    assert not isinstance(err.value, ConfigError)  # a bug in what is saved, not a disk problem: shown in full
    assert_previous_intact(tmp_path, 1.0)


def test_full_disk_is_a_one_line_error(tmp_path):
    """ENOSPC for real: the temp file's writes go to /dev/full (open follows the symlink put at its name)."""
    ckpt.save_atomic(big_state(1.0), tmp_path / "last.pt")
    (tmp_path / f".last.pt.tmp{os.getpid()}").symlink_to("/dev/full")  # the temp name save_atomic picks
    with pytest.raises(ConfigError) as err:
        ckpt.save_atomic(big_state(2.0), tmp_path / "last.pt")
    assert str(err.value) == (
        f"cannot write checkpoint {tmp_path / 'last.pt'}: No space left on device; free "
        f"space or set hydra.run.dir elsewhere"
    )
    assert "\n" not in str(err.value)
    assert_previous_intact(tmp_path, 1.0)


def test_write_cut_short_by_file_size_limit(tmp_path):
    """A file-size limit stops the write after 64 KiB of an 800 KB checkpoint (EFBIG, as a full disk would)."""
    code = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from pathlib import Path
        from src.state import checkpoint as ckpt
        from src.config.errors import ConfigError
        from tests.state.test_checkpoint import big_state
        path = Path({str(tmp_path / "last.pt")!r})
        ckpt.save_atomic(big_state(1.0), path)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write(2) instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
        try:
            ckpt.save_atomic(big_state(2.0), path)
        except ConfigError as exc:
            print(exc)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        f"cannot write checkpoint {tmp_path / 'last.pt'}: File too large; free space or set hydra.run.dir elsewhere\n"
    )
    assert_previous_intact(tmp_path, 1.0)


def test_truncated_checkpoint_is_a_one_line_error(tmp_path):
    ckpt.save_atomic(big_state(1.0), tmp_path / "last.pt")
    data = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(data[: len(data) // 2])  # e.g. copied while being written
    with pytest.raises(ConfigError) as err:
        ckpt.load(tmp_path / "last.pt")
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'last.pt'} is unreadable (")
    assert message.endswith("; pass another checkpoint") and "\n" not in message


def test_a_checkpoint_that_does_not_exist_says_what_to_pass(tmp_path):
    """The same line serves trainer.resume, ckpt_path (train=false) and the export command: no key of one of them."""
    with pytest.raises(ConfigError) as err:
        ckpt.load(tmp_path / "nope.pt")
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'nope.pt'} does not exist; pass one train.py wrote (a run's checkpoints/last.pt "
        f"or best.pt, or checkpoints/last/ of a sharded fsdp run)"
    )


# --- src/state/runlock.py: one live run per run directory (it guards the checkpoints of that directory) ---

HOLD = (
    "import sys, time; from src.state.runlock import RunLock; RunLock(sys.argv[1]).acquire(); "
    "print('locked', flush=True); time.sleep(300)"
)
TRY = "import sys; from src.state.runlock import RunLock\nwith RunLock(sys.argv[1]): print('acquired')"


def in_use(run_dir, pid: int) -> str:
    return f"{run_dir} is in use by another live run (pid {pid}); wait for it or use another run directory"


def test_live_holder_blocks_and_killed_holder_does_not(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(ConfigError) as err:
            RunLock(run_dir).acquire()
        assert str(err.value) == in_use(run_dir, holder.pid)
    finally:
        holder.kill()  # SIGKILL: no cleanup code runs, the kernel drops the flock
        holder.wait()
    assert holder.returncode == -signal.SIGKILL
    with RunLock(run_dir) as lock:  # the crashed run's lock file is still there but does not block
        assert lock.held and (run_dir / ".lock").read_text() == f"{os.getpid()}\n"


def test_ranks_of_an_earlier_launch_hold_the_run_dir_until_they_end(tmp_path):
    """A launcher that died leaves its ranks saving their checkpoint: a new run into that dir is refused in one
    line until the last of them has ended."""
    rank = (
        "import sys, time; from src.state.runlock import hold_as_rank; hold_as_rank(sys.argv[1]); "
        "print('held', flush=True); time.sleep(300)"
    )
    holder = subprocess.Popen([sys.executable, "-c", rank, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match="still held by the ranks of an earlier launch"):
            RunLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait()
    with RunLock(tmp_path) as lock:
        assert lock.held


def test_lock_is_released_on_exit(tmp_path):
    try_lock = [sys.executable, "-c", TRY, str(tmp_path)]
    with RunLock(tmp_path):
        proc = subprocess.run(try_lock, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1
        assert proc.stderr.strip().endswith(f"ConfigError: {in_use(tmp_path, os.getpid())}")
    proc = subprocess.run(try_lock, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (0, "acquired\n"), proc.stderr


def test_find_while_another_rank_publishes_a_sharded_checkpoint_never_fails(tmp_path):
    """A rank looked up `last` while rank 0 renamed it to `.last.old` (between its exists() and its stat() of
    state.pt): a FileNotFoundError ended the rank (seen once in CI, fsdp's restart test)."""
    import threading

    from src.state.checkpoint import STATE, _publish, find

    def write(directory: Path) -> None:
        directory.mkdir()
        (directory / STATE).write_bytes(b"x")

    write(tmp_path / "last")
    done = threading.Event()

    def publish_again_and_again():
        while not done.is_set():
            write(tmp_path / ".last.tmp")
            _publish(tmp_path / ".last.tmp", tmp_path / "last")

    thread = threading.Thread(target=publish_again_and_again)
    thread.start()
    try:
        for _ in range(3000):
            assert find(tmp_path, "last").name in ("last", ".last.old")
    finally:
        done.set()
        thread.join()
