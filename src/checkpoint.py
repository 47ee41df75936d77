"""Checkpoints: written atomically (temp file + rename), read with one-line errors."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from src.config import ConfigError


def save_atomic(state: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # readers see the old file or the new one, never half of one


def load(path: Path | str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"checkpoint {path} does not exist; pass an existing file or trainer.resume=none")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise ConfigError(f"checkpoint {path} is unreadable ({type(exc).__name__}: {str(exc)[:80]}); "
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
                else f"shape of {shapes[0]} is {tuple(saved[shapes[0]].shape)} vs {tuple(model_state[shapes[0]].shape)}")
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
