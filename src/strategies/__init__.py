"""The `strategy/` group: one class per strategy, chosen by `_target_` in conf/strategy/<name>.yaml.

A strategy owns everything that differs between them: how many processes and devices it needs
(checked against the machine or the launcher before anything starts), how it wraps and compiles the
model, skipping gradient sync on accumulation micro-steps, gradient and buffer sync, the module to
evaluate, checkpoint state in and out, and what it supports. Nothing else compares strategy names.
Adding one: a subclass in a module here, re-exported below (or in any importable module), and a YAML
naming it (docs/extending.md).

- `base.py`      `Strategy` (the base: one process, one device), `Context`, the process-group base of
                 ddp and fsdp, checkpoint state in and out, `build_strategy`
- `single.py`    `Single`, `DataParallel`
- `ddp.py`       `DDP` and its flat after-backward gradient sync (`FlatGradientSync`)
- `fsdp.py`      `FSDP` (FSDP2 fully_shard, compile per unit, CUDA graphs for one unit, prefetch, sharded checkpoints)
- `sync_batchnorm.py`  ddp's `sync_bn`: BatchNorm over the global batch, its statistics gathered inside the graph
- `graph_shards.py`  fsdp's in-graph route: each rank's rows gathered by ops of the compiled graph
- `local_shards.py`  an FSDP optimizer stepped over the local shards with fused kernels
- `blocks.py`    `shard_targets`: a model's blocks (FSDP units, activation-checkpointing units)
- `activation_checkpointing.py`  `apply_activation_checkpointing`
"""

from src.strategies.activation_checkpointing import apply_activation_checkpointing
from src.strategies.base import Context, Strategy, build_strategy
from src.strategies.base import _Distributed as _Distributed
from src.strategies.blocks import shard_targets
from src.strategies.ddp import COMM_DTYPES, DDP, FlatGradientSync
from src.strategies.ddp import _flat_layout_strides as _flat_layout_strides
from src.strategies.fsdp import FSDP
from src.strategies.single import DataParallel, Single

__all__ = [
    "COMM_DTYPES",
    "DDP",
    "FSDP",
    "Context",
    "DataParallel",
    "FlatGradientSync",
    "Single",
    "Strategy",
    "apply_activation_checkpointing",
    "build_strategy",
    "shard_targets",
]
