"""`EMA` (trainer.ema): an exponential moving average of the model's weights, kept beside them on the device.

Like timm's ModelEmaV3 (its default): floating-point parameters and buffers (BatchNorm running stats) are
averaged, integer buffers (`num_batches_tracked`) copied. The average is held as plain tensors of this rank's
part of the model (under fsdp the local shards, so it is sharded like the parameters); for evaluation and
checkpoints it is swapped into the model itself, so every strategy's state-dict and sharding code serves it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter or buffer: the local shard of an fsdp DTensor (a view that writes through)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def lerp_update(average: list[torch.Tensor], model: list[torch.Tensor], decay: float) -> None:
    """average <- decay * average + (1 - decay) * model, in place, as one foreach kernel (no host sync)."""
    torch._foreach_lerp_(average, model, 1.0 - decay)


class EMA:
    """The average of `module`'s weights, updated every `every_n_steps` optimizer steps with `decay` per update,
    times (step / total_steps) ** ramp_power. With `copy_back` it is a lookahead: the model continues from the
    average after each update (airbench's recipe)."""

    def __init__(
        self,
        module: nn.Module,
        decay: float,
        every_n_steps: int = 1,
        ramp_power: float = 0.0,
        total_steps: int = 1,
        copy_back: bool = False,
    ):
        self.module, self.decay, self.every_n_steps = module, decay, every_n_steps
        self.ramp_power, self.total_steps, self.copy_back = ramp_power, total_steps, copy_back
        averaged, copied = self.live()
        self.average = [t.detach().clone() for t in averaged]
        self.copies = [t.detach().clone() for t in copied]

    @torch.no_grad()
    def live(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's floating-point tensors (averaged) and the others (counters: copied), looked up at each
        use: FSDP replaces a parameter's local tensor when it first runs or loads a state dict, and a module
        left gathered (the root after an evaluation's forward) is first resharded to its local shards."""
        from torch.distributed.fsdp import FSDPModule

        for sub in self.module.modules():
            if isinstance(sub, FSDPModule):
                sub.reshard()
        tensors = [_local(t) for t in (*self.module.parameters(), *self.module.buffers())]
        return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimizer step `step` (counted from the run's start, so a resumed run updates at the same steps)."""
        if step % self.every_n_steps:
            return
        averaged, copied = self.live()
        decay = self.decay * (min(step, self.total_steps) / self.total_steps) ** self.ramp_power
        lerp_update(self.average, averaged, decay)
        if self.copy_back:
            torch._foreach_copy_(averaged, self.average)
        if copied:
            torch._foreach_copy_(self.copies, copied)

    @torch.no_grad()
    def capture(self) -> None:
        """Start the average from the model's current weights (a new run, or one resumed without an average)."""
        averaged, copied = self.live()
        torch._foreach_copy_(self.average, averaged)
        if copied:
            torch._foreach_copy_(self.copies, copied)

    @torch.no_grad()
    def _swap(self) -> None:
        for held, live in zip((self.average, self.copies), self.live()):
            if held:
                stash = [t.clone() for t in live]
                torch._foreach_copy_(live, held)
                torch._foreach_copy_(held, stash)

    @contextlib.contextmanager
    def swapped(self):
        """The model holds the average inside (to evaluate or save it); its own weights come back after, bit for
        bit, and what the block did to the average's tensors (a buffer broadcast from rank 0) stays with it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()
