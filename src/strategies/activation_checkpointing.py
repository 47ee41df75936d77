"""trainer.activation_checkpointing: each block recomputed in the backward, with any strategy."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from src.config.errors import ConfigError
from src.strategies.blocks import _replace, shard_targets


def apply_activation_checkpointing(model: nn.Module, blocks: list[nn.Module] | None = None) -> None:
    """trainer.activation_checkpointing: each block keeps only its input from the forward and recomputes the
    rest in the backward (activation memory of one block at a time, ~1/3 more compute). `blocks`: by default
    `shard_targets(model, "auto")`; the trainer passes `strategy.blocks(model)`, FSDP's units. torch's
    CheckpointWrapper keeps state_dict() names and the checkpoint helpers drop its prefix: a checkpoint saved
    with activation checkpointing loads without it, and back."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = shard_targets(model, "auto") if blocks is None else blocks
    if not blocks:
        raise ConfigError(
            f"trainer.activation_checkpointing=true finds no block in {type(model).__name__} to "
            f"recompute (a child with layers inside); set trainer.activation_checkpointing=false"
        )
    for block in blocks:
        _replace(model, block, checkpoint_wrapper(block, checkpoint_fn=_checkpoint))


def _checkpoint(module: nn.Module, *args, **kwargs):
    """torch.utils.checkpoint of `module`, whose recomputation leaves the buffers as the forward left them
    (BatchNorm would count each batch twice in its running stats). Compiled, the recomputation is part of the
    backward graph and updates nothing."""
    from torch.utils.checkpoint import checkpoint

    if torch.compiler.is_compiling() or not any(True for _ in module.buffers()):
        return checkpoint(module, *args, use_reentrant=False, **kwargs)
    return checkpoint(
        module,
        *args,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _buffers_kept(module)),
        **kwargs,
    )


@contextlib.contextmanager
def _buffers_kept(module: nn.Module):
    saved = [b.clone() for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(module.buffers(), saved):
                buffer.copy_(value)
