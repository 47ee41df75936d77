"""How an option's type, range and choices are declared and checked (the declarations live elsewhere).

The YAML files under conf/ hold the defaults. What values a group allows is declared once, beside the
code that reads it: a dataclass of the group's options (e.g. `TrainerOptions` in src/run/trainer_options.py)
or the signature of the group's `_target_` class or function (e.g. the strategy classes).
src/run/plan.py collects them into one check before any process starts. A bad value is one
`ConfigError` line naming the key, what it must be and what it got.

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
