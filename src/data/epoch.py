"""Which samples each rank takes, step by step, and the batches sent to the workers ahead of the trainer.

`data.batch_size` is the GLOBAL batch of one optimizer step. Each epoch, a permutation drawn from
(seed, epoch) is cut into global batches; each global batch is cut into world_size x accumulate
micro-batches, and rank r takes micro-batch k * world_size + r at micro-step k. So the union over
ranks and micro-steps of a step is exactly the single-device batch of that step.
Evaluation shards each split into contiguous, unpadded pieces: every sample is seen exactly once.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from src.data.draws import epoch_generator


@dataclass
class Step:
    micro: list[torch.Tensor]  # this rank's sample ids, one tensor per micro-step
    global_count: int  # samples in the whole optimizer step, over all ranks


@dataclass
class MicroBatch:
    x: torch.Tensor
    y: torch.Tensor
    boundary: bool  # last micro-step of an optimizer step
    global_count: int  # samples in the optimizer step over all ranks
    mix: tuple = ()  # mixup/cutmix: (each sample's other label, the weight of y); y is the dominant label


def plan_epoch(
    n: int, global_batch: int, world: int, rank: int, accumulate: int, seed: int, epoch: int, drop_last: bool = False
) -> list[Step]:
    """This rank's steps for one epoch. A short last global batch is kept (split as evenly as possible)
    unless it has fewer samples than world_size x accumulate, or drop_last is set."""
    perm = torch.randperm(n, generator=epoch_generator(seed, epoch, stream=0))
    steps = []
    for start in range(0, n, global_batch):
        batch = perm[start : start + global_batch]
        if len(batch) < world * accumulate or (drop_last and len(batch) < global_batch):
            break
        chunks = torch.tensor_split(batch, world * accumulate)
        steps.append(Step([chunks[k * world + rank] for k in range(accumulate)], len(batch)))
    return steps


def eval_shard(n: int, world: int, rank: int) -> torch.Tensor:
    return torch.tensor_split(torch.arange(n), world)[rank]


def micro_batches(steps: list[Step]) -> list[torch.Tensor]:
    """An epoch's batches of sample ids, in the order the loop takes them: each step's micro-batches."""
    return [ids for step in steps for ids in step.micro]


def with_boundaries(steps: list[Step]) -> Iterator[tuple[torch.Tensor, bool, int]]:
    """(sample ids, last micro-step of its step, samples in the step) of each micro-batch, in order."""
    for step in steps:
        for k, ids in enumerate(step.micro):
            yield ids, k == len(step.micro) - 1, step.global_count


class ReadAhead:
    """Pieces sent to the workers before the trainer asks for them, as one pass: segments (split, epoch, batches
    of sample ids), taken in order. A segment asked for differently, or one left half taken, ends it."""

    def __init__(self, loader_key: str, segments: list, fetched: Iterator):
        self.loader_key, self.segments, self.fetched, self.owed = loader_key, collections.deque(segments), fetched, 0

    def take(self, split: str, epoch: int | None, batches: list[torch.Tensor], pieces: int) -> Iterator | None:
        """The `pieces` fetched pieces of these batches, if they are the next segment; else None."""
        if self.owed or not self.segments:
            return None
        want, when, sent = self.segments[0]
        same = (want, when, len(sent)) == (split, epoch, len(batches)) and all(map(torch.equal, sent, batches))
        if not same:
            return None
        self.segments.popleft()
        self.owed = pieces
        return self._give()

    def _give(self) -> Iterator:
        while self.owed:
            item = next(self.fetched)
            self.owed -= 1
            yield item
