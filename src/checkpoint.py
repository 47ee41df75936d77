"""Checkpoints: written atomically (temp file + rename), read with one-line errors."""
from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import numpy as np
import torch

from src.config import ConfigError


class _FileWriter:
    """Unbuffered writes that raise the OS error (ENOSPC, EFBIG, EIO) and remember it: torch.save turns a
    failed write into an opaque RuntimeError, so the real cause is kept here for the message."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            while view:  # os.write may write part of the buffer; the next call reports why
                view = view[os.write(self.fd, view):]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return len(data)

    def flush(self) -> None:
        pass


def save_atomic(state: dict, path: Path) -> None:
    """Write `state` to `path` so that readers see the old file or the new one, never half of one. On failure
    the temp file is removed; an OS error (full disk, read-only or missing directory) is a one-line ConfigError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # written through the file descriptor only: nothing buffered in f
            writer = _FileWriter(f.fileno())
            try:
                torch.save(state, writer)
            except Exception as exc:
                raise writer.error or exc
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # e.g. ENOTDIR: there was no temp file to remove
            tmp.unlink()
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot write checkpoint {path}: {exc.strerror or exc}; free space or set "
                              f"hydra.run.dir elsewhere") from exc
        raise  # not the disk's fault (e.g. an unpicklable object): a bug to see in full


def load(path: Path | str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist; pass an existing file or trainer.resume=none")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        cause = " ".join(str(exc).split())[:80]  # one line, whatever torch says
        raise ConfigError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {cause}); "
                          f"pass another file or trainer.resume=none") from None
    if not isinstance(state, dict) or "model" not in state:
        raise ConfigError(f"{path} is not a ddplab checkpoint (no 'model' entry); pass a file written by train.py")
    return state


def check_compatible(state: dict, model_state: dict, path) -> None:
    """Same parameter names and shapes, or a one-line error naming the first difference."""
    saved = state["model"]
    missing = [k for k in model_state if k not in saved]
    unexpected = [k for k in saved if k not in model_state]
    shapes = [k for k in model_state if k in saved and tuple(saved[k].shape) != tuple(model_state[k].shape)]
    if missing or unexpected or shapes:
        what = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected
                else f"shape of {shapes[0]} is {tuple(saved[shapes[0]].shape)} vs "
                     f"{tuple(model_state[shapes[0]].shape)}")
        raise ConfigError(f"checkpoint {path} does not match this model/data ({what}); use the model= and "
                          f"data= it was trained with, or trainer.resume=none")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
