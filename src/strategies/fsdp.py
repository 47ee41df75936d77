"""`FSDP`: FSDP2 (fully_shard) with compile per unit, prefetch, mixed precision, CPU offload and sharded
(DCP) checkpoints; or, where the whole model is one unit under CUDA graphs, the collectives inside the compiled
graph (src/strategies/graph_shards.py)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from src.config.errors import ConfigError
from src.config.schema import Positive
from src.state import checkpoint as ckpt
from src.strategies.base import Context, _broadcast_from_rank0, _dcp, _Distributed
from src.strategies.blocks import _replace, inside, shard_targets
from src.strategies.graph_shards import BUCKETED, dtensor_views, shard_rows, sharded_grad_norm, unshardable
from src.strategies.local_shards import step_on_local_shards


@dataclass
class FSDP(_Distributed):
    """FSDP2 (torch.distributed.fsdp.fully_shard) laid out as torchtitan does: each block compiled on its own
    (trainer.compile), then sharded as one unit, with the next unit's all-gather prefetched explicitly; the root
    holds what no block does (stem, head). For models whose blocks are small, the root alone is the one unit
    (`per_block`) and the whole forward is compiled as one graph. Checkpoints are sharded (DCP) by default."""

    shard_modules: Literal["auto", "blocks", "root"] | list[str] | None = "auto"  # the units: see `per_block`
    reshard_after_forward: bool | Annotated[int, Positive] = True  # int n: regather from groups of n ranks
    prefetch: bool | Annotated[int, Positive] = True  # all-gather the next unit(s) early: true = 1, n = n ahead
    param_dtype: Literal["bf16", "fp32"] | None = None  # null: trainer.amp's dtype with amp, else fp32
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # of the gradient reduce-scatter
    cpu_offload: bool = False  # sharded parameters, gradients and optimizer step on the CPU
    checkpoint_format: Literal["sharded", "full"] = "sharded"
    collectives: Literal["auto", "hooks", "graph"] = "auto"  # FSDP2's hooks around units, or ops in the graph
    bucket_collectives: bool = True  # graph: inductor merges the step's all-gathers and its reduce-scatters

    _blocks_in_root: ClassVar[bool] = False  # set by wrap
    _shards: ClassVar[list] = []  # set by wrap on the in-graph route: the sharded parameters
    auto_block_mib: ClassVar[float] = 32.0  # auto shards each block on its own from this mean block size (fp32)

    name: ClassVar[str] = "fsdp"
    gathers_to_host: ClassVar[bool] = True
    fused_optimizer: ClassVar[bool] = False  # the fused kernels do not take DTensor parameters: see prepare_optimizer
    channels_last_weights: ClassVar[bool] = False  # FSDP2 cannot shard non-contiguous weights
    averages_gradients: ClassVar[bool] = True

    def processes(self, requested, available, device_type, launched, launched_local):
        world, per_process = super().processes(requested, available, device_type, launched, launched_local)
        group = self.reshard_after_forward
        if not isinstance(group, bool) and world % group:
            divisors = [str(d) for d in range(2, world) if world % d == 0]
            raise ConfigError(
                f"strategy.reshard_after_forward={group} must divide the {world} ranks (the group "
                f"each parameter is regathered from in the backward); use "
                f"{', '.join(['true', 'false', *divisors])}"
            )
        return world, per_process

    def preflight(self, cfg):
        from src.models import build_model

        with torch.device("meta"):
            model = build_model(cfg.model, num_classes=10, in_channels=3, start=False)
        blocks = self.blocks(model)
        t = cfg.trainer
        if self.collectives == "graph":
            self._check_in_graph(model, blocks)
        if t.compile and t.compile_mode == "reduce-overhead":
            if self.per_block(blocks) and self.reshard_after_forward is not False:
                raise ConfigError(
                    f"trainer.compile_mode=reduce-overhead (CUDA graphs) works under fsdp when each unit is gathered "
                    f"once per step, but {len(blocks)} units of their own (strategy.shard_modules="
                    f"{self.shard_modules}) are gathered again for the backward; set "
                    f"strategy.reshard_after_forward=false, strategy.shard_modules=root or trainer.compile_mode=default"
                )
            if self.cpu_offload:
                raise ConfigError(
                    "trainer.compile_mode=reduce-overhead (CUDA graphs) does not work with strategy.cpu_offload=true "
                    "(the parameters live on the CPU); set trainer.compile_mode=default"
                )

    def _check_in_graph(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """strategy.collectives=graph gathers the whole model once per step, on the device, by rows."""
        why = unshardable(model)
        if why:
            why = f"{why}; keep each parameter in one module with at least one dimension"
        elif self.per_block(blocks):
            why = (
                f"strategy.shard_modules={self.shard_modules} makes {len(blocks)} units; set "
                f"strategy.shard_modules=root"
            )
        elif self.cpu_offload:
            why = "the parameters then live on the CPU; drop strategy.cpu_offload"
        elif not isinstance(self.reshard_after_forward, bool):
            why = f"strategy.reshard_after_forward={self.reshard_after_forward} regathers from groups of ranks; drop it"
        if why:
            raise ConfigError(
                f"strategy.collectives=graph gathers the whole model inside its compiled graph, but {why} "
                f"or set strategy.collectives=hooks"
            )

    def gathers_in_graph(self, model: nn.Module, per_block: bool, cuda_graphs: bool) -> bool:
        """The in-graph route: asked for, or (auto) where CUDA graphs would replay a whole-model unit: there FSDP2's
        hooks leave the host launching the collectives around the graphs, at a few ms per step."""
        if self.collectives == "auto":
            one_unit = not per_block and not self.cpu_offload and isinstance(self.reshard_after_forward, bool)
            return cuda_graphs and one_unit and unshardable(model) is None
        return self.collectives == "graph"

    def hparams(self, cfg):
        """gradient_sync: the reduce-scatter inside the compiled graph (`graph`) or from FSDP2's hooks (after wrap)."""
        return {**super().hparams(cfg), "gradient_sync": "graph" if self._shards else "hooks"}

    def memory_fixes(self, devices):
        fixes = ["set strategy.shard_modules=blocks"] if self._blocks_in_root else []
        fixes += [] if self.reshard_after_forward is True else ["set strategy.reshard_after_forward=true"]
        fixes += [] if self.cpu_offload else ["set strategy.cpu_offload=true"]
        return [*fixes, "shard over more GPUs (trainer.devices, more nodes)"]

    def blocks(self, model):
        """The model's blocks (`shard_targets`), or the modules of the classes named in shard_modules: each is
        recomputed as one (activation checkpointing) and, as a unit of its own, compiled on its own."""
        return shard_targets(model, self.shard_modules if isinstance(self.shard_modules, list) else "auto")

    def per_block(self, blocks: list[nn.Module]) -> bool:
        """Is each block sharded on its own (one unit per block), or the root alone (the whole model one unit,
        gathered once per step)? Each unit costs a few host milliseconds per step, which a small block's compute
        cannot hide (eager ResNet-18 on 2 H100s: 14,588 images/s per GPU with its 8 blocks as units, 36,259 as one
        unit), and only large blocks save memory worth having: so auto shards each block when the blocks average
        at least `auto_block_mib` MiB of fp32 parameters (ViT-L and larger), else the root alone."""
        if self.shard_modules == "auto":
            mib = sum(p.numel() for block in blocks for p in block.parameters()) * 4 / 2**20
            return bool(blocks) and mib / len(blocks) >= self.auto_block_mib
        return self.shard_modules != "root"

    def dtypes(self, ctx: Context) -> tuple[torch.dtype | None, torch.dtype]:
        """(the dtype parameters are gathered in, None: as kept; the dtype gradients are reduced in)."""
        dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
        # on the CPU, BatchNorm's kernel takes no bf16 weights: there autocast alone computes in amp's dtype
        from_amp = ctx.amp_dtype if ctx.amp and ctx.device.type == "cuda" else None
        return dtypes[self.param_dtype] if self.param_dtype else from_amp, dtypes[self.reduce_dtype]

    def mp_policy(self, ctx: Context):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        param, reduce = self.dtypes(ctx)
        return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)

    def wrap(self, model, ctx):
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        blocks = self.blocks(model)
        per_block = self.per_block(blocks)
        if self.gathers_in_graph(model, per_block, ctx.cuda_graphs):
            return self._wrap_in_graph(model, ctx)
        units = blocks if per_block else []
        if ctx.compile and per_block:  # one graph per block (repeated blocks share it); FSDP's hooks outside them
            parts = _compiled_parts(model, units)
            limit = torch._dynamo.config.recompile_limit  # a graph per distinct block shape (resnet: ~8)
            torch._dynamo.config.recompile_limit = max(limit, len(parts))
            compiled = {
                id(p): _replace(model, p, torch.compile(p, mode=ctx.compile_mode, dynamic=False)) for p in parts
            }
            units = [compiled.get(id(u), u) for u in units]
        self._blocks_in_root = bool(blocks) and not per_block  # an out-of-memory line then suggests per-block units
        options = {
            "mp_policy": self.mp_policy(ctx),
            "offload_policy": CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy(),
        }
        for unit in units:
            fully_shard(unit, reshard_after_forward=self.reshard_after_forward, **options)
        fully_shard(model, **options)  # the root stays gathered from forward to backward: its backward comes first
        if ctx.cuda_graphs:  # each unit gathered once per step (preflight)
            _graph_inputs_in_place(model, units, ctx.device)
        if ctx.compile and not per_block:  # one unit: its forward is one graph, FSDP's hooks run around the call
            model.forward = torch.compile(model.forward, mode=ctx.compile_mode, dynamic=False)
        ahead = int(self.prefetch)  # the next `ahead` units' all-gathers are issued when a unit's is done
        for i, unit in enumerate([model, *units][:-1] if ahead else []):  # forward: the root, then the units
            unit.set_modules_to_forward_prefetch(units[i : i + ahead])
        for i, unit in enumerate(units[1:] if ahead else [], start=1):  # backward: in reverse order
            unit.set_modules_to_backward_prefetch(units[max(0, i - ahead) : i][::-1])
        self.core = self.model = model
        self.eager = _Eager(model) if ctx.compile else model
        return self.model

    def _wrap_in_graph(self, model: nn.Module, ctx: Context) -> nn.Module:
        """Each parameter kept as this rank's rows, gathered by an op of the model's graph; the model compiled whole."""
        param, reduce = self.dtypes(ctx)
        self._shards = shard_rows(model, param or torch.float32, reduce)
        self.fused_optimizer = True  # the parameters are plain tensors: torch's fused kernels take them
        self.core = self.eager = model
        self.model = ctx.compiled(model, **(BUCKETED if self.bucket_collectives else {}))
        return self.model

    def prepare_optimizer(self, optimizer, fused):
        """Stepped over the local shards, fused on CUDA unless they live on the CPU (src/strategies/local_shards.py)."""
        if self._shards:  # already over the plain rows
            return optimizer
        return step_on_local_shards(optimizer, fused and not self.cpu_offload)

    def eval_module(self):
        self.sync_buffers()
        return self.eager

    def sync_context(self, boundary):
        if self._shards:  # each backward reduce-scatters inside its graph: the micro-steps' shards add up
            return contextlib.nullcontext()
        return contextlib.nullcontext() if boundary else _fsdp_no_sync(self.core)

    def clip_gradients(self, max_norm):
        if not self._shards:
            return super().clip_gradients(max_norm)
        total = sharded_grad_norm(self._shards)
        torch.nn.utils.clip_grads_with_norm_([s.param for s in self._shards], max_norm, total)
        return total

    def replicated_parameters(self):
        return [] if self._shards else super().replicated_parameters()

    # the in-graph route shows its rows to torch's state-dict helpers as FSDP2's DTensors
    def state_dict(self, optimizer, offload=True):
        with dtensor_views(self._shards, optimizer):
            return super().state_dict(optimizer, offload)

    def load_state_dict(self, model_state, optimizer=None, optim_state=None, strict=True):
        with dtensor_views(self._shards, optimizer):
            return super().load_state_dict(model_state, optimizer, optim_state, strict)

    def ema_state(self, full, offload=True):
        with dtensor_views(self._shards):
            return super().ema_state(full, offload)

    def load_checkpoint(self, path, optimizer=None, head=frozenset()):
        with dtensor_views(self._shards, optimizer):
            return super().load_checkpoint(path, optimizer, head)

    def sync_buffers(self):
        """FSDP2 leaves buffers (BatchNorm running stats) replicated and unsynchronized: take rank 0's, as
        DDP's broadcast_buffers does, so every rank evaluates with the same weights and stats."""
        if dist.is_initialized():
            _broadcast_from_rank0(self.core, parameters=False)

    def save_checkpoint(self, directory, names, optimizer, state, primary, background=None):
        with dtensor_views(self._shards, optimizer):
            self._save_checkpoint(directory, names, optimizer, state, primary, background)

    def _save_checkpoint(self, directory, names, optimizer, state, primary, background):
        if self.checkpoint_format == "full":
            return super().save_checkpoint(directory, names, optimizer, state, primary, background)
        self.sync_buffers()  # DCP writes a replicated buffer from one rank, not necessarily rank 0
        average = {"ema": self.ema_state(full=False)} if self.ema else {}  # sharded like the model
        model_state, optim_state = _dcp().get_state_dict(self.core, optimizer)  # this rank's shards: nothing gathered
        tensors = {"model": model_state, "optimizer": optim_state, **average}
        ckpt.save_sharded(tensors, state, directory, names, primary)


class _Eager(nn.Module):
    """`module` with its compiled blocks run eagerly: evaluation (no grad, eval-mode norms, an odd last
    batch) would otherwise compile every block again."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        with torch.compiler.set_stance("force_eager"):
            return self.module(x)


def _compiled_parts(model: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """What is compiled, each on its own, when FSDP shards units of their own: the model's blocks that hold no
    unit (in the root too: resnet's early stages when only `layer4` is a unit), and the units that hold no such
    block. FSDP's hooks then run between the compiled parts, never inside one."""
    blocks = [b for b in shard_targets(model, "auto") if not any(inside(u, b) for u in units)]
    return blocks + [u for u in units if not any(b is u or inside(b, u) for b in blocks)]


def _graph_inputs_in_place(root: nn.Module, units: list[nn.Module], device: torch.device) -> None:
    """Keep what the CUDA graphs read in place, so that they replay rather than being recorded again. Dynamo takes an
    FSDP-managed module's buffers for ordinary inputs, and runs a graph that mutates one (BatchNorm's running
    statistics) without CUDA graphs: they are marked static. The gathered parameters are static inputs too, and move
    with FSDP's allocations: `_gather_in_own_pool`."""
    for buffer in root.buffers():
        torch._dynamo.mark_static_address(buffer, guard=False)
    if device.type == "cuda":
        _gather_in_own_pool([root, *units])


def _gather_in_own_pool(units: list[nn.Module]) -> None:
    """Route the allocations of the units' FSDP pre-forwards (the all-gathers, the prefetched ones included, and the
    unsharded parameters) to a memory pool of their own. CUDA graphs take the parameters as static inputs and
    record again when one moves; FSDP frees the gathered parameters after each backward and allocates them anew
    before the next forward, where the loader's and metrics' allocations in between would move them. In a pool
    that sees only these allocations, in the same order each step, they land where they were."""
    pool, entered = torch.cuda.MemPool(), []

    def enter(module, args, kwargs):  # prepended: runs before FSDP's pre-forward hook
        entered.append(torch.cuda.use_mem_pool(pool))
        entered[-1].__enter__()

    def leave(module, args, kwargs):  # appended: runs after it
        entered.pop().__exit__(None, None, None)

    for unit in units:
        unit.register_forward_pre_hook(leave, with_kwargs=True)
        unit.register_forward_pre_hook(enter, with_kwargs=True, prepend=True)


@contextlib.contextmanager
def _fsdp_no_sync(core: nn.Module):
    core.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        core.set_requires_gradient_sync(True)
