"""The `trainer/` group's options (conf/trainer/default.yaml), read by the training loop (src/run/trainer.py).

They are declared here rather than in trainer.py because src/run/plan.py checks them before any process
starts, and trainer.py imports plan.py to plan a run it is handed none for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from src.config.schema import Fraction, NonNegative, Positive, PositiveReal
from src.state.run_state import EarlyStopping


@dataclass
class Ema:
    """An exponential moving average of the weights, evaluated and checkpointed beside them (src/strategies/ema.py)."""

    decay: Annotated[float, Fraction] | None  # per update; null: off
    every_n_steps: Annotated[int, Positive]
    ramp_power: Annotated[float, NonNegative]  # the decay x (step / total steps) ** this: young runs average less
    copy_back: bool  # lookahead: after each update the model itself continues from the average


@dataclass
class TrainerOptions:
    max_epochs: Annotated[int, Positive]
    devices: Literal["auto"] | Annotated[int, Positive]
    device: Literal["auto", "cpu", "cuda"]
    amp: bool
    amp_dtype: Literal["bf16", "fp16"]
    accumulate_grad_batches: Annotated[int, Positive]
    channels_last: bool
    compile: bool
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
    deterministic: bool
    cudnn_benchmark: bool
    label_smoothing: Annotated[float, Fraction]
    grad_clip: Annotated[float, PositiveReal] | None
    resume: str | None
    init_from: str | None
    max_restarts: Annotated[int, NonNegative]
    limit_train_batches: Annotated[int, Positive] | None
    limit_eval_batches: Annotated[int, Positive] | None
    log_every_n_steps: Annotated[int, NonNegative]
    progress_bar: bool
    test_every_epoch: bool
    flip_tta: bool
    tta_shift: Annotated[int, NonNegative]
    threads: Literal["auto"] | Annotated[int, Positive]
    activation_checkpointing: bool
    early_stopping: EarlyStopping
    ema: Ema
    save_top_k: Annotated[int, Positive] | None
    checkpoint_every_n_steps: Annotated[int, Positive] | None
