"""fsdp's in-graph route (strategy.collectives=graph): each rank keeps its rows of every parameter, and ops inside
the model's own graph gather them (forward) and reduce-scatter their gradients (backward).

FSDP2 issues its collectives from hooks around each unit, which CUDA graphs cannot hold; here they are functional
collectives that torch.compile traces into the forward and backward graphs, so `compile_mode=reduce-overhead`
replays the whole sharded step (torchtitan's SimpleFSDP takes the same route). The rows a rank keeps are
torch.chunk's along dim 0, as FSDP2's Shard(0): `dtensor_views` shows them to torch's state-dict helpers and DCP as
DTensors, so checkpoints are those of FSDP2 in either format.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


class _GatherRows(torch.autograd.Function):
    """This rank's rows -> the whole parameter in `dtype` (all-gather); its gradient -> this rank's rows of the
    ranks' mean, reduced in `reduce_dtype` (reduce-scatter)."""

    @staticmethod
    def forward(ctx, rows, whole_rows, chunk, group, dtype, reduce_dtype):
        import torch.distributed._functional_collectives as fc

        ctx.own, ctx.group, ctx.reduce_dtype, ctx.master_dtype = rows.shape[0], group, reduce_dtype, rows.dtype
        rows = rows.to(dtype)
        if rows.shape[0] < chunk:  # the last ranks' chunks are short (torch.chunk): padded to one size
            rows = torch.cat([rows, rows.new_zeros(chunk - rows.shape[0], *rows.shape[1:])])
        gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # the name of torch < 2.12
        return gather(rows, 0, group)[:whole_rows]

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed._functional_collectives as fc

        world = dist.get_world_size(ctx.group)
        grad = grad.to(ctx.reduce_dtype)
        padded = -grad.shape[0] % world
        if padded:
            grad = torch.cat([grad, grad.new_zeros(padded, *grad.shape[1:])])
        scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
        mean = scatter(grad.contiguous(), "sum", 0, ctx.group) / world
        return mean[: ctx.own].to(ctx.master_dtype), None, None, None, None, None


@dataclass
class RowShard:
    """One sharded parameter: `module._parameters[name]` holds this rank's rows of a parameter of `shape`."""

    module: nn.Module
    name: str
    shape: torch.Size
    chunk: int  # rows per rank (torch.chunk's size; the last ranks may hold fewer)

    @property
    def param(self) -> nn.Parameter:
        """What the module holds now: this rank's rows (or, inside `dtensor_views`, their DTensor view)."""
        return self.module._parameters[self.name]

    @param.setter
    def param(self, value: nn.Parameter) -> None:
        self.module._parameters[self.name] = value


def unshardable(model: nn.Module) -> str | None:
    """Why `model`'s parameters cannot each be kept by rows (a scalar, or one shared by two modules), or None."""
    seen = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, param in module._parameters.items():
            where = f"{prefix}.{name}" if prefix else name
            if param is not None and id(param) in seen:
                return f"{where} is shared by two modules"
            if param is not None and param.dim() == 0:
                return f"{where} has no rows (a scalar)"
            seen.add(id(param))
    return None


# inductor's passes that merge the step's collectives: one all-gather, a few reduce-scatters (fewer NCCL launches)
BUCKETED = {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"}


def shard_rows(model: nn.Module, dtype: torch.dtype, reduce_dtype: torch.dtype, group=None) -> list[RowShard]:
    """Keep this rank's rows of each of `model`'s parameters (none `unshardable`); reading `module.<name>` gathers
    the whole (in `dtype`). Every rank must hold the same weights when called (each keeps its own rows of them)."""
    group = group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shards = []
    for module in list(model.modules()):
        gathers = {}  # name -> _GatherRows' arguments after the rows
        for name, whole in list(module._parameters.items()):
            if whole is None:
                continue
            chunk = -(-whole.shape[0] // world)
            rows = whole.detach().contiguous()[rank * chunk : (rank + 1) * chunk].clone()
            module._parameters[name] = nn.Parameter(rows, requires_grad=whole.requires_grad)
            shards.append(RowShard(module, name, whole.shape, chunk))
            gathers[name] = (whole.shape[0], chunk, group, dtype, reduce_dtype)
        if gathers:
            module._gather_rows = gathers
            module.__class__ = _gathering_class(type(module), tuple(gathers))
    return shards


def _gathering_class(cls: type, names: tuple[str, ...]) -> type:
    """`cls` whose parameters `names` read as the whole (gathered); the class keeps its name, so modules print as
    before."""

    def reader(name):
        return property(lambda self: _GatherRows.apply(self._parameters[name], *self._gather_rows[name]))

    return type(cls.__name__, (cls,), {name: reader(name) for name in names})


def sharded_grad_norm(shards: list[RowShard]) -> torch.Tensor:
    """The global norm of the sharded parameters' gradients (each rank holds disjoint rows: squares summed)."""
    params = [s.param for s in shards]
    grads = [p.grad for p in params if p.grad is not None]
    square = torch.nn.utils.get_total_norm(grads).square() if grads else params[0].new_zeros((), dtype=torch.float32)
    dist.all_reduce(square)
    return square.sqrt()


@contextlib.contextmanager
def dtensor_views(shards: list[RowShard], optimizer: torch.optim.Optimizer | None = None):
    """While inside: the sharded parameters (and the optimizer's state for them) are DTensors with placement
    Shard(0) over the same storage, as FSDP2's, for torch's state-dict helpers and DCP to read and write. Afterwards
    the plain rows are back in place, holding what was loaded."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if not shards or _is_dtensor(shards[0].param):  # nested: the outer view serves
        yield
        return
    plains = [s.param for s in shards]
    shard_of = dict(zip(plains, shards))
    mesh = DeviceMesh.from_group(dist.group.WORLD, plains[0].device.type)

    def view(plain, tensor):
        shape = shard_of[plain].shape
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)

    def state_view(plain, value):  # the optimizer's per-row state (momentum, Adam's moments), not its scalars
        tensor = isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == plain.shape
        return view(plain, value) if tensor and plain in shard_of else value

    views = {p: nn.Parameter(view(p, p.detach()), requires_grad=p.requires_grad) for p in plains}
    plain_of = {v: p for p, v in views.items()}
    gathering = {}  # module -> its gathering class, while the helpers read `module.<name>` as the parameter
    for s, plain in zip(shards, plains):
        s.param = views[plain]
        if s.module not in gathering:
            gathering[s.module] = type(s.module)
            s.module.__class__ = type(s.module).__bases__[0]
    fused = []
    if optimizer is not None:
        for group in optimizer.param_groups:
            group["params"] = [views.get(p, p) for p in group["params"]]
            fused.append(group.get("fused"))
            if group.get("fused"):  # torch's fused kernels take no DTensors (its helpers may step once, lr 0)
                group["fused"] = False
        optimizer.state = _rekeyed(optimizer.state, views, state_view)
    try:
        yield
    finally:
        with torch.no_grad():
            for s, plain in zip(shards, plains):
                if s.param is not views[plain]:  # a helper assigned a new parameter: keep its values, not it
                    plain.copy_(s.param.to_local())
                s.param = plain
            for module, cls in gathering.items():
                module.__class__ = cls
        if optimizer is not None:
            for group, flag in zip(optimizer.param_groups, fused):
                group["params"] = [plain_of.get(p, p) for p in group["params"]]
                if flag is not None:
                    group["fused"] = flag
            optimizer.state = _rekeyed(optimizer.state, plain_of, lambda p, v: v.to_local() if _is_dtensor(v) else v)


def _is_dtensor(value) -> bool:
    return hasattr(value, "to_local")


def _rekeyed(state, keys: dict, convert):
    """The optimizer's state keyed by `keys[param]`, each tensor `convert(param, value)`."""
    from collections import defaultdict

    out = defaultdict(dict)
    for param, values in state.items():
        out[keys.get(param, param)] = {k: convert(param, v) for k, v in values.items()}
    return out
