"""One live run per run directory: an exclusive flock on `<run_dir>/.lock`.

    with RunLock(run_dir):   # ConfigError if another live process holds it
        ...train...

The kernel releases a flock when the process holding it dies (even by SIGKILL or OOM), so a crashed run
never blocks its resume or a SLURM requeue. The file keeps the holder's pid for the error message; it is
never deleted (unlinking a lock file lets two processes lock two different inodes).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from src.config.errors import ConfigError

RANKS = ".lock.ranks"  # each rank started by the local launcher holds a shared lock on it while it lives


def hold_as_rank(run_dir: Path | str) -> int:
    """In a rank: a shared lock on the run dir, kept until the process ends (the kernel drops it then)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)  # an evaluation's ranks may be the first to write there
    fd = os.open(Path(run_dir) / RANKS, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


class RunLock:
    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".lock"
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock without waiting, or raise ConfigError naming the live holder's pid."""
        if self.held:
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # no O_TRUNC: the holder's pid stays readable
        except OSError as exc:
            raise ConfigError(f"cannot lock the run directory: {self.path} ({exc.strerror}); remove it") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"{self.run_dir} is in use by another live run (pid {holder}); wait for it or use another run directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        if not self._no_ranks_left():
            os.close(fd)
            raise ConfigError(
                f"{self.run_dir} is still held by the ranks of an earlier launch (they save and exit within a minute "
                f"of their launcher's death); wait for them or use another run directory"
            )
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _no_ranks_left(self) -> bool:
        """No rank of an earlier launch holds the run dir (RankHold): their launcher may have died before them."""
        try:
            fd = os.open(self.run_dir / RANKS, os.O_RDWR)
        except FileNotFoundError:  # no launch started ranks here yet
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # releases the probe's lock

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # now, even if a forked child (loader worker) shares the fd
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
