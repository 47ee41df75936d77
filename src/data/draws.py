"""Where the random choices come from: a torch generator per (seed, epoch, stream), and counter-based numbers that
are a function of (seed, epoch, sample id) alone, so any worker, rank or resumed run computes a sample's own."""

from __future__ import annotations

import numpy as np
import torch


def epoch_generator(seed: int, epoch: int, stream: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + stream)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijection of uint64 whose outputs pass statistical tests as random."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def sample_uniforms(seed: int, epoch: int, ids, count: int, stream: int = 3) -> np.ndarray:
    """float64 len(ids) x count in [0, 1): sample `id`'s numbers of the epoch, a function of (seed, epoch, id)
    alone (counter-based, splitmix64), so a worker computes only its batch's and nothing per epoch is stored
    (ImageNet: 1.28M x 41 numbers), whatever the batch, rank or resume point."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        key = np.array([seed % 2**64], dtype=np.uint64)
        for part in (epoch, stream):
            key = _mix64(key ^ np.uint64(part % 2**64)) + _GOLDEN
        counters = np.asarray(ids, dtype=np.uint64)[:, None] * np.uint64(count) + np.arange(count, dtype=np.uint64)
        bits = _mix64(key + counters * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53
