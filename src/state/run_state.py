"""What a run must remember to resume: its position, best epoch and history, and the checkpoints that hold them;
and the options its `Monitor` reads (`objective`, `trainer.early_stopping`), declared beside it."""

from __future__ import annotations

import logging
import reprlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import torch
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError
from src.config.schema import NonNegative, Positive
from src.state import checkpoint as ckpt

log = logging.getLogger("ddplab")


@dataclass
class Objective:
    """What `train.py` returns to a sweeper: a figure of the validation split, so hyper-parameters are never
    selected on the test set."""

    metric: Literal["val_top1", "val_top5", "val_loss"]
    direction: Literal["maximize", "minimize"]


@dataclass
class EarlyStopping:
    """trainer.early_stopping: stop once objective.metric has not improved by more than min_delta for `patience`
    epochs (null: never)."""

    patience: Annotated[int, Positive] | None
    min_delta: Annotated[float, NonNegative]


@dataclass(frozen=True)
class Monitor:
    """The validation figure (objective.metric) that picks best.pt and the top-k checkpoints and stops a run
    early: one setting for the sweep's score and the run's own choices. Each choice is a function of the
    history alone, so a resumed run makes the same ones."""

    metric: str = "val_top1"
    maximize: bool = True
    patience: int | None = None  # epochs without an improvement of more than min_delta before stopping
    min_delta: float = 0.0

    @classmethod
    def of(cls, cfg: DictConfig) -> Monitor:
        stopping = cfg.trainer.early_stopping
        return cls(cfg.objective.metric, cfg.objective.direction == "maximize", stopping.patience, stopping.min_delta)

    def better(self, value: float, than: float, by: float = 0.0) -> bool:
        return value - by > than if self.maximize else value + by < than

    def ranked(self, history: list[dict]) -> list[dict]:
        """Epochs best first; of equal ones the earlier (a later epoch must beat it to replace it)."""
        sign = -1 if self.maximize else 1
        return sorted(history, key=lambda row: (sign * row[self.metric], row["epoch"]))

    def best(self, history: list[dict]) -> dict:
        """The best epoch's row; with no validation split, the latest."""
        return self.ranked(history)[0] if self.metric in history[-1] else history[-1]

    def top_k_name(self, row: dict) -> str:
        """A top-k checkpoint's name: epoch and value (no `=`, which a Hydra override could not pass unquoted)."""
        return f"epoch{row['epoch']}-{self.metric}-{row[self.metric]:.4f}"

    def stop_reason(self, history: list[dict]) -> str | None:
        """Why training ends early after these epochs, or None to go on."""
        if self.patience is None or not history:
            return None
        reference, waited = None, 0
        for row in history:
            if reference is None or self.better(row[self.metric], reference, self.min_delta):
                reference, waited = row[self.metric], 0
            else:
                waited += 1
        if waited < self.patience:
            return None
        best, epochs = self.best(history), f"{waited} epoch{'s' if waited > 1 else ''}"
        return (
            f"early stopping after epoch {history[-1]['epoch']}: {self.metric} did not improve by more than "
            f"{self.min_delta:g} for {epochs} (patience {self.patience}; best {best[self.metric]:.4f} at "
            f"epoch {best['epoch']})"
        )


@dataclass
class Progress:
    """Where training stands; saved with every checkpoint."""

    epoch: int = 0  # the epoch to run next (or the one interrupted)
    step: int = 0  # optimizer steps of `epoch` already done (a mid-epoch checkpoint)
    partial_totals: torch.Tensor | None = None  # that epoch's loss sum / hits / samples so far, over all ranks
    best_epoch: int = 0
    history: list[dict] = field(default_factory=list)
    crop_on_device: bool | None = None  # data.crop=auto's measured choice, once made (kept by a resume)

    def record(self, row: dict, monitor: Monitor) -> bool:
        """Add an epoch's row; True if its weights are the best so far."""
        self.history.append(row)
        self.best_epoch = monitor.best(self.history)["epoch"]
        self.epoch, self.step, self.partial_totals = row["epoch"], 0, None
        return self.best_epoch == row["epoch"]

    @property
    def train_seconds(self) -> float:
        return self.history[-1]["train_sec_total"] if self.history else 0.0


class Checkpoints:
    """`<run dir>/checkpoints/{last,best}` and the top-k ones (`epoch<e>-<metric>-<value>`): the strategy decides
    the format (a `.pt` file written by rank 0, or a sharded directory every rank writes into:
    src/state/checkpoint.py); either format resumes and evaluates anywhere."""

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        strategy,
        optimizer,
        scheduler,
        scaler,
        primary: bool,
        model_io=None,
        background: bool = False,
    ):
        """model_io: the model's class count and input shape, kept in each checkpoint (export rebuilds from it).
        background: rank 0 writes a full checkpoint while the next epoch trains (for a GPU's run: on the CPU the
        writing thread would take cores from the training)."""
        self.dir, self.cfg, self.primary, self.model_io = run_dir / "checkpoints", cfg, primary, model_io
        self.strategy, self.optimizer, self.scheduler, self.scaler = strategy, optimizer, scheduler, scaler
        self.resumed_from: Path | None = None
        self.background = ckpt.BackgroundWrites() if background else None
        if primary and cfg.train:  # the run lock is held: a temp file here is a killed save's, never a live one
            ckpt.remove_partial_writes(self.dir)

    def resume_path(self) -> Path | None:
        resume, last = self.cfg.trainer.resume, ckpt.find(self.dir, "last")
        if resume in (None, "none"):
            if last is not None:
                raise ConfigError(
                    f"{self.dir.parent} already holds a run (checkpoints/{last.name}) and "
                    f"trainer.resume=none would overwrite it; use trainer.resume=auto or a new run "
                    f"directory"
                )
            return None
        if resume == "auto":
            return last
        return Path(resume)

    def save(self, names: list[str], progress: Progress) -> None:
        """Collective; `names`: "last", "best" (a ".pt" suffix is ignored). With `background`, a full checkpoint
        is still being written on return: `saved` or `wait` ends the write."""
        self.wait()  # one save at a time, whatever the format
        totals = progress.partial_totals
        state = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": progress.epoch,
            "step": progress.step,
            "partial_totals": None if totals is None else totals.cpu(),
            "best_epoch": progress.best_epoch,
            "history": progress.history,
            "crop_on_device": progress.crop_on_device,
            "rng": ckpt.rng_state(),
            "strategy": self.strategy.name,
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "model_io": self.model_io,
            "ema_decay": self.strategy.ema.decay if self.strategy.ema else None,  # its weights: `ema` (strategies)
        }
        names = [name.removesuffix(".pt") for name in names]
        self.strategy.save_checkpoint(self.dir, names, self.optimizer, state, self.primary, self.background)

    def saved(self, name: str) -> Path:
        """The checkpoint `name` once the write in flight has ended."""
        self.wait()
        return ckpt.find(self.dir, name) or self.dir / name

    def wait(self, raising: bool = True) -> None:
        """End the write in flight; `raising`: its error, if it failed, is raised here."""
        if self.background is not None:
            self.background.wait(raising)

    def keep_only(self, top_k: list[str]) -> None:
        """Rank 0: remove the top-k checkpoints (`epoch<e>-...`) that are no longer among the k best."""
        if not self.primary:
            return
        for path in self.dir.glob("epoch*"):
            if path.name.removesuffix(".pt") not in top_k:
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def load_weights(self, path, with_optimizer: bool = False) -> dict:
        return self.strategy.load_checkpoint(path, self.optimizer if with_optimizer else None)

    def restore(self, path: Path) -> Progress:
        state = self.load_weights(path, with_optimizer=True)
        progress = progress_of(state, Path(path))
        self.resumed_from = Path(path)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        ckpt.set_rng_state(state["rng"])
        if self.primary:
            log.info("resumed from %s at epoch %d step %d", path, progress.epoch + 1, progress.step)
        return progress

    def final_weights(self, best_epoch: int) -> Path:
        """The best epoch's weights: this run's best.pt; for a run resumed from another dir's checkpoint whose best
        epoch came before the resume, the checkpoint it resumed from or that dir's best, whichever holds it."""
        own = ckpt.find(self.dir, "best")
        if own is not None or self.resumed_from is None:
            return own or ckpt.find(self.dir, "last") or self.dir / "last.pt"
        for candidate in (self.resumed_from, ckpt.find(self.resumed_from.parent, "best")):
            if candidate is not None and _holds_epoch(candidate, best_epoch):
                return candidate
        last = ckpt.find(self.dir, "last") or self.resumed_from
        if self.primary:
            log.warning(
                "epoch %d's weights (the best) are neither in %s nor beside %s: the final figures are of %s",
                best_epoch,
                self.dir,
                self.resumed_from,
                last,
            )
        return last


class _Absent:
    def __repr__(self) -> str:
        return "absent"


def _whole(value) -> bool:
    return type(value) is int and value >= 0


PROGRESS_ENTRIES = {  # a checkpoint's entry -> (what train.py writes there, the test of it)
    "epoch": ("a whole number", _whole),
    "step": ("a whole number", _whole),
    "partial_totals": ("None or 3 sums", lambda v: v is None or (isinstance(v, torch.Tensor) and v.shape == (3,))),
    "best_epoch": ("a whole number", _whole),
    "history": ("a list of epoch rows", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v)),
    "crop_on_device": ("None, true or false", lambda v: v is None or type(v) is bool),
}


def progress_of(state: dict, path: Path) -> Progress:
    """The checkpoint's `Progress`, or a one-line refusal naming the first entry train.py would not have written
    (a crafted or damaged file); `crop_on_device` may be absent (checkpoints written before it)."""
    values = {key: state.get(key, None if key == "crop_on_device" else _Absent()) for key in PROGRESS_ENTRIES}
    for key, (what, valid) in PROGRESS_ENTRIES.items():
        if not valid(values[key]):
            raise ConfigError(
                f"checkpoint {path} is refused: its {key!r} is {reprlib.repr(values[key])}, not {what}; "
                "pass a checkpoint written by train.py"
            )
    return Progress(**values)


def _holds_epoch(path: Path, epoch: int) -> bool:
    """Whether checkpoint `path` was saved at the end of `epoch`."""
    state = ckpt.load(path)
    return state.get("epoch") == epoch and not state.get("step")
