"""Every option's type, range and choices, declared once and checked before any process starts.

The YAML files under conf/ hold the defaults; the declarations here (and the signatures of the
`_target_` classes and functions, e.g. the strategy classes) say what values are allowed. A bad
value is one `ConfigError` line naming the key, what it must be and what it got.

A declaration is a type hint: `bool`, `int`, `float`, `str`, `Literal[...]`, `X | None`, `list[X]`,
optionally wrapped in `Annotated[X, Range(...)]`.
"""

from __future__ import annotations

import difflib
import inspect
import types
import typing
from dataclasses import dataclass, fields, is_dataclass
from typing import Annotated, Any, Literal, Union

from omegaconf import DictConfig, ListConfig, OmegaConf

from src.config.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """Bounds of a number; `open_hi=True` excludes `hi` itself (e.g. fractions in [0, 1))."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False

    def holds(self, v) -> bool:
        return (self.lo is None or (v > self.lo if self.open_lo else v >= self.lo)) and (
            self.hi is None or (v < self.hi if self.open_hi else v <= self.hi)
        )

    def __str__(self) -> str:
        if self.lo == 1 and self.hi is None and not self.open_lo:
            return "positive"
        lo = "" if self.lo is None else f"{'>' if self.open_lo else '>='} {_number(self.lo)}"
        hi = "" if self.hi is None else f"{'<' if self.open_hi else '<='} {_number(self.hi)}"
        return " and ".join(p for p in (lo, hi) if p)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


Positive = Range(1)  # integers >= 1
NonNegative = Range(0)
PositiveReal = Range(0, open_lo=True)
Fraction = Range(0, 1, open_hi=True)  # [0, 1)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        base, ranges = args[0], [str(a) for a in args[1:] if isinstance(a, Range)]
        described = _describe(base)
        if ranges and ranges[0] == "positive":
            return described.replace("an integer", "a positive integer")
        return f"{described} {' '.join(ranges)}".strip()
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_describe(args[0])}" if args else "a list"
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        type(None): "null",
        Any: "anything",
    }.get(hint, getattr(hint, "__name__", str(hint)))


def _fits(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin is Annotated:
        return _fits(value, args[0]) and all(a.holds(value) for a in args[1:] if isinstance(a, Range))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin in (list, tuple):
        return (
            isinstance(value, (list, tuple, ListConfig)) and all(_fits(v, args[0]) for v in value)
            if args
            else isinstance(value, (list, tuple, ListConfig))
        )
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint)


def check_value(where: str, value, hint) -> None:
    if not _fits(value, hint):
        raise ConfigError(f"{where} must be {_describe(hint)}, got {value!r}")


def declared(obj) -> dict[str, Any]:
    """The options a dataclass or a callable (class or function) declares, with their type hints."""
    if is_dataclass(obj):
        hints = typing.get_type_hints(obj, include_extras=True)
        return {f.name: hints[f.name] for f in fields(obj) if f.init}
    target = obj.__init__ if inspect.isclass(obj) else obj
    hints = typing.get_type_hints(target, include_extras=True)
    params = inspect.signature(target).parameters
    return {
        n: hints.get(n, Any)
        for n, p in params.items()
        if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def check_section(cfg: DictConfig | None, prefix: str, spec, skip: tuple[str, ...] = (), strict: bool = True) -> None:
    """Check every declared key of `cfg` (a config group) against `spec`; with strict, refuse keys the
    spec does not declare (a typo would otherwise be ignored, or fail later as a traceback)."""
    if cfg is None:
        return
    options = declared(spec)
    for key in cfg:
        if key in skip or key.startswith("_"):
            continue
        if key not in options:
            if strict:
                raise ConfigError(
                    f"{prefix}.{key} is not an option of {prefix} "
                    f"({getattr(spec, '__name__', spec)}); choose among {', '.join(sorted(options))}"
                )
            continue
        value = OmegaConf.select(cfg, key, throw_on_missing=False)
        if OmegaConf.is_missing(cfg, key):
            raise ConfigError(f"{prefix}.{key} must be set (it has no default); add {prefix}.{key}=...")
        if is_dataclass(options[key]):  # a group inside the group (trainer.early_stopping)
            if not isinstance(value, DictConfig):
                names = ", ".join(f"{prefix}.{key}.{name}" for name in declared(options[key]))
                raise ConfigError(f"{prefix}.{key} is a group of options ({names}); set those, got {value!r}")
            check_section(value, f"{prefix}.{key}", options[key])
            continue
        check_value(f"{prefix}.{key}", value, options[key])


def refuse_lookalikes(cfg: DictConfig, prefix: str, known, hint: str = "") -> None:
    """For groups that may hold keys of the user's own (read by their code or interpolated elsewhere): a key that
    is not one of `known` but looks like one (num_worker, partion) is a typo, refused with the key it resembles."""
    for key in cfg:
        close = [] if key in known else difflib.get_close_matches(key, list(known), n=1, cutoff=0.8)
        if close:
            raise ConfigError(f"{prefix}.{key} is not a {prefix} option; {hint}did you mean {prefix}.{close[0]}?")


def target_of(cfg: DictConfig, prefix: str):
    """The class or function named by `<prefix>._target_`, or a one-line error."""
    from hydra.utils import get_object

    name = cfg.get("_target_")
    if not name:
        raise ConfigError(f"{prefix} has no _target_; name the class or function that builds it")
    try:
        return get_object(name)
    except Exception:  # ImportError, AttributeError wrapped by Hydra
        raise ConfigError(f"{prefix}._target_={name} cannot be imported; check the module and name") from None


# --- the groups without a _target_ of their own -------------------------------------------------


@dataclass
class EarlyStopping:
    """Stop once objective.metric has not improved by more than min_delta for `patience` epochs (null: never)."""

    patience: Annotated[int, Positive] | None
    min_delta: Annotated[float, NonNegative]


@dataclass
class Ema:
    """An exponential moving average of the weights, evaluated and checkpointed beside them (src/strategies/ema.py)."""

    decay: Annotated[float, Fraction] | None  # per update; null: off
    every_n_steps: Annotated[int, Positive]


@dataclass
class Trainer:
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


@dataclass
class Optim:
    """torch's optimizers declare no types: the options ddplab's optim/ YAMLs use, with their ranges."""

    lr: Annotated[float, PositiveReal]
    momentum: Annotated[float, Fraction]
    nesterov: bool
    weight_decay: Annotated[float, NonNegative]
    betas: list[Annotated[float, Fraction]]
    eps: Annotated[float, PositiveReal]
    decay_norm_and_bias: bool
    pretrained_lr_scale: Annotated[float, Range(0, 1, open_lo=True)]


@dataclass
class ModelStart:
    """Every model's starting point and frozen part (src/models.py `build_model`), beside its builder's options."""

    weights: str | None
    freeze: str | list[str] | None  # prefixes, or backbone


@dataclass
class Objective:
    """What `train.py` returns to a sweeper: a figure of the validation split, so hyper-parameters are never
    selected on the test set."""

    metric: Literal["val_top1", "val_top5", "val_loss"]
    direction: Literal["maximize", "minimize"]


@dataclass
class Top:
    seed: Annotated[int, Range(0, 2**32 - 1)]  # what every RNG takes (numpy's limit)
    train: bool
    ckpt_path: str | None
    predict: bool


def check(cfg: DictConfig) -> None:
    """Every option of the composed config, before any process starts or any file is written."""
    groups = ("paths", "data", "model", "optim", "scheduler", "strategy", "trainer", "cluster", "logger", "objective")
    for key in cfg:
        if key not in groups and key not in declared(Top) and key != "hydra":
            raise ConfigError(
                f"{key} is not an option; the top level has {', '.join(declared(Top))} and the "
                f"groups {', '.join(groups)}"
            )
    for key in declared(Top):
        check_value(key, cfg.get(key), declared(Top)[key])
    if cfg.predict and cfg.train:
        raise ConfigError("predict=true writes an evaluation's predictions: add train=false ckpt_path=<checkpoint>")
    check_section(cfg.trainer, "trainer", Trainer)
    check_section(cfg.objective, "objective", Objective)
    metric, direction = cfg.objective.metric, cfg.objective.direction
    if (direction == "minimize") != str(metric).endswith("_loss"):
        raise ConfigError(
            f"objective.direction={direction} with objective.metric={metric} would select the worst trial; "
            f"set objective.direction={'minimize' if metric.endswith('_loss') else 'maximize'}"
        )
    check_section(cfg.optim, "optim", Optim, skip=("_partial_",))
    if len(cfg.optim.get("betas", [0, 0])) != 2:
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    for group in ("model", "scheduler", "strategy"):  # their _target_'s signature is their schema
        skip = ("_partial_", "name", "num_classes", "in_channels", *(declared(ModelStart) if group == "model" else ()))
        check_section(cfg[group], group, target_of(cfg[group], group), skip=skip)
    start = [key for key in declared(ModelStart) if key in cfg.model]  # a model YAML of your own may lack them
    check_section(OmegaConf.masked_copy(cfg.model, start), "model", ModelStart)
    check_starting_point(cfg)
    for name, options in (cfg.get("logger") or {}).items():
        check_section(options, f"logger.{name}", target_of(options, f"logger.{name}"), skip=("run_dir", "cfg"))
    refuse_lookalikes(cfg.paths, "paths", ("root_dir", "data_dir", "log_dir", "output_dir"))


def check_starting_point(cfg: DictConfig) -> None:
    """One starting point at most, and the options that need one."""
    m, t = cfg.model, cfg.trainer
    if m.get("weights") and m.get("pretrained"):
        raise ConfigError("model.weights and model.pretrained=true both name the starting weights; choose one")
    if t.get("init_from") and (m.get("weights") or m.get("pretrained")):
        raise ConfigError(
            "trainer.init_from takes every weight from its checkpoint; drop model.weights and model.pretrained"
        )
    if t.get("init_from") and cfg.train and t.resume not in (None, "none", "auto"):
        raise ConfigError(f"trainer.init_from starts a new run and trainer.resume={t.resume} continues one; choose one")
    scale = cfg.optim.get("pretrained_lr_scale", 1.0)
    if (
        isinstance(scale, (int, float))
        and 0 < scale < 1
        and not (m.get("weights") or m.get("pretrained") or t.get("init_from"))
    ):
        raise ConfigError(
            f"optim.pretrained_lr_scale={scale} scales the learning rate of pretrained weights, but the model starts "
            f"from none; set model.pretrained=true, model.weights=<file> or trainer.init_from=<checkpoint>"
        )
