"""A model's blocks: the units FSDP shards (and compiles) and activation checkpointing recomputes."""

from __future__ import annotations

from torch import nn

from src.config.errors import ConfigError


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _composite(module: nn.Module) -> bool:
    """A block (layers inside), not a single layer."""
    return any(_has_params(child) for child in module.children())


def _stack(module: nn.Module) -> bool:
    """A Sequential/ModuleList/ModuleDict of several blocks: resnet's layerN, a transformer's blocks."""
    return (
        isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))
        and sum(map(_composite, module.children())) > 1
    )


def _blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks of the innermost stacks under `module`, and its other composite children; not its single layers."""
    found = []
    for child in module.children():
        if any(_stack(m) for m in child.modules() if m is not child):
            found += _blocks(child)  # finer blocks inside (torchvision's ViT encoder, convnext's stages)
        elif _stack(child):
            found += [block for block in child.children() if _has_params(block)]
        elif _composite(child):
            found.append(child)
    return found


def shard_targets(model: nn.Module, spec) -> list[nn.Module]:
    """The model's blocks, in definition order: each is one FSDP unit (one all-gather, one reduce-scatter) and
    one activation-checkpointing unit; what no block holds (a stem layer, a norm, the classifier) stays in the
    root. auto: the blocks of its innermost stacks (resnet's bottlenecks, ViT's encoder blocks) and its other
    composite children; a list of names: the outermost modules of those classes (BasicBlock) or at those paths
    (layer4, features.1)."""
    if spec in (None, "auto"):
        targets = _blocks(model)
    else:
        names = set(spec)
        targets = _outermost(model, lambda path, m: path in names or type(m).__name__ in names)
        if not targets:
            found = sorted({type(m).__name__ for m in model.modules()})
            paths = [name for name, _ in model.named_children()]
            raise ConfigError(
                f"strategy.shard_modules={sorted(names)} matches no module of the model; "
                f"choose among the classes {found[:15]} or the paths {paths[:10]}, or use auto"
            )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    # a block under activation checkpointing is sharded and compiled together with its wrapper
    wrappers = {id(m._checkpoint_wrapped_module): m for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [wrappers.get(id(t), t) for t in targets]


def _outermost(module: nn.Module, match, prefix: str = "") -> list[nn.Module]:
    found = []
    for name, child in module.named_children():
        path = prefix + name
        found += [child] if match(path, child) else _outermost(child, match, path + ".")
    return found


def inside(module: nn.Module, outer: nn.Module) -> bool:
    """Is `module` a strict sub-module of `outer`?"""
    return module is not outer and any(m is module for m in outer.modules())


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> nn.Module:
    """Put `new` where `old` is in `model` (the same attribute or Sequential slot); return `new`."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return new
    raise ValueError(f"{type(old).__name__} is not a sub-module of {type(model).__name__}")
