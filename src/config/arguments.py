"""argparse types of the module command lines (`python -m src.data.shards`, `src.run.export`) and of bench/'s
scripts: a value out of range is argparse's one-line usage error (`invalid positive value: '0'`), never a
traceback or a silent misreading later."""

from __future__ import annotations

import math


def positive(text: str) -> int:
    """A whole number >= 1."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def non_negative(text: str) -> int:
    """A whole number >= 0."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def positive_number(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(text)
    return value


def fraction(text: str) -> float:
    """A number from 0 to 1."""
    value = float(text)
    if not 0 <= value <= 1:  # NaN too
        raise ValueError(text)
    return value


def jpeg_quality(text: str) -> int:
    """A JPEG quality on Pillow's scale, 1 to 100."""
    value = int(text)
    if not 1 <= value <= 100:
        raise ValueError(text)
    return value
