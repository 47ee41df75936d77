"""The `model/` group. Every builder takes num_classes and in_channels from the data; `build_model` adds the
starting point (model.pretrained, model.weights) and model.freeze, which `ModelStart` declares."""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
from torch import nn

from src.config.errors import ConfigError
from src.config.schema import Fraction, Positive, PositiveReal, declared, target_of
from src.state.checkpoint import check_compatible, safe_torch_load

log = logging.getLogger("ddplab")


@dataclass
class ModelStart:
    """Every model's starting point and frozen part, read by `build_model` (not by the builders, whose signatures
    declare the rest of the model group)."""

    weights: str | None
    freeze: str | list[str] | None  # prefixes, or backbone


def cifar_resnet18(num_classes: int, in_channels: int = 3) -> nn.Module:
    """ResNet-18 with the CIFAR stem: 3x3 stride-1 first conv and no max-pool (32x32 inputs keep detail)."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def _conv_bn(cin: int, cout: int, pool: bool = False) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
    return nn.Sequential(*layers, nn.MaxPool2d(2)) if pool else nn.Sequential(*layers)


class ResNet9(nn.Module):
    """The 9-layer residual net of the DAWNBench CIFAR-10 entries: three conv stages that halve the
    resolution with max-pooling, residual pairs after the first and last, a max-pooled linear head
    whose logits are scaled down (keeps the early softmax soft at high learning rates)."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        width: Annotated[int, Positive] = 64,
        logit_scale: Annotated[float, PositiveReal] = 0.125,
    ):
        super().__init__()
        w = width
        self.prep = _conv_bn(in_channels, w)
        self.layer1 = _conv_bn(w, 2 * w, pool=True)
        self.res1 = nn.Sequential(_conv_bn(2 * w, 2 * w), _conv_bn(2 * w, 2 * w))
        self.layer2 = _conv_bn(2 * w, 4 * w, pool=True)
        self.layer3 = _conv_bn(4 * w, 8 * w, pool=True)
        self.res3 = nn.Sequential(_conv_bn(8 * w, 8 * w), _conv_bn(8 * w, 8 * w))
        self.head = nn.Linear(8 * w, num_classes, bias=False)
        self.logit_scale = logit_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.prep(x))
        x = x + self.res1(x)
        x = self.layer3(self.layer2(x))
        x = x + self.res3(x)
        return self.head(x.amax(dim=(2, 3))) * self.logit_scale


class AirbenchNet(nn.Module):
    """The network of airbench96 (Keller Jordan's CIFAR-10 speed runs), written for ddplab: a frozen 2x2
    patch-whitening convolution fitted to the training images (`fit_to_images`), three stages of three 3x3
    convolutions (pool after the first; a residual around the last two) with GELU and BatchNorm whose scale is
    not learned, identity-initialised convolutions, and a max-pooled linear head with scaled-down logits."""

    def __init__(
        self,
        num_classes: int,
        in_channels: int = 3,
        widths: list[Annotated[int, Positive]] = (128, 512, 512),
        bn_momentum: Annotated[float, Fraction] = 0.4,
        logit_scale: Annotated[float, PositiveReal] = 1 / 9,
        whiten_eps: Annotated[float, PositiveReal] = 5e-4,
    ):
        super().__init__()
        patch = 2 * 2 * in_channels
        self.whiten_eps, self.logit_scale = whiten_eps, logit_scale
        # +/- each whitened direction, so the GELU after it keeps both signs
        self.register_buffer("whiten", torch.zeros(2 * patch, in_channels, 2, 2))
        self.whiten_bias = nn.Parameter(torch.zeros(2 * patch))
        stages, cin = [], 2 * patch
        for width in widths:
            stages.append(_AirbenchStage(cin, width, bn_momentum))
            cin = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(cin, num_classes, bias=False)

    @torch.no_grad()
    def fit_to_images(self, images: torch.Tensor) -> None:
        """Set the whitening filters from normalized N x C x H x W training images: the eigenvectors of the
        2x2 patches' covariance, each scaled by 1 / sqrt(eigenvalue + eps). In float64 on the CPU, so every
        rank computes the same filters."""
        c = images.shape[1]
        covariance, count = torch.zeros(4 * c, 4 * c, dtype=torch.float64), 0
        for chunk in images.split(500):
            patches = chunk.double().cpu().unfold(2, 2, 1).unfold(3, 2, 1)  # N x C x H' x W' x 2 x 2
            rows = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, 4 * c)
            covariance += rows.T @ rows
            count += len(rows)
        values, vectors = torch.linalg.eigh(covariance / count)
        filters = (vectors.T / (values[:, None] + self.whiten_eps).sqrt()).reshape(4 * c, c, 2, 2)
        self.whiten.copy_(torch.cat([filters, -filters]).to(self.whiten))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.gelu(nn.functional.conv2d(x, self.whiten.to(x.dtype), self.whiten_bias.to(x.dtype)))
        x = self.stages(x)
        return self.head(nn.functional.max_pool2d(x, 3).flatten(1)) * self.logit_scale


def refuse_fit_from_disk(model_cfg, data_name: str, random_resized_crop: bool) -> None:
    """A model that fits a layer to the training images (`fit_to_images`) needs them in memory: one line naming the
    fix when they are read from disk (random resized crops always are)."""
    if hasattr(target_of(model_cfg, "model"), "fit_to_images"):
        fix = "set data.augment=crop_flip" if random_resized_crop else "raise data.max_memory_gb"
        raise ConfigError(
            f"model._target_={model_cfg._target_} fits its first layer to training images held in memory, "
            f"but data={data_name} is read from disk here; {fix} or pick another model"
        )


class _AirbenchStage(nn.Module):
    def __init__(self, cin: int, cout: int, bn_momentum: float):
        super().__init__()
        self.conv1, self.conv2, self.conv3 = _dirac_conv(cin, cout), _dirac_conv(cout, cout), _dirac_conv(cout, cout)
        self.norm1, self.norm2, self.norm3 = (_shift_only_norm(cout, bn_momentum) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = nn.functional.gelu
        x = gelu(self.norm1(nn.functional.max_pool2d(self.conv1(x), 2)))
        return x + gelu(self.norm3(self.conv3(gelu(self.norm2(self.conv2(x))))))


def _dirac_conv(cin: int, cout: int) -> nn.Conv2d:
    """3x3 'same' convolution whose first min(cin, cout) filters start as the identity (the rest as torch's)."""
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
    nn.init.dirac_(conv.weight[: min(cin, cout)])
    return conv


def _shift_only_norm(channels: int, momentum: float) -> nn.BatchNorm2d:
    """BatchNorm whose scale stays 1: only its shift is learned."""
    norm = nn.BatchNorm2d(channels, eps=1e-12, momentum=momentum)
    norm.weight.requires_grad_(False)
    return norm


def torchvision_classifier(name: str, num_classes: int, in_channels: int = 3, pretrained: bool = False) -> nn.Module:
    """torchvision's `name`; pretrained: its default weights from the torch hub cache (never downloaded)."""
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available:
        raise ConfigError(
            f"model.name={name!r} is not a torchvision classifier; e.g. one of {', '.join(sorted(available)[:12])}, ..."
        )
    if in_channels != 3:
        raise ConfigError(
            f"model=torchvision expects 3-channel images but the data has {in_channels}; "
            f"use model=resnet18 or model=tiny_cnn"
        )
    model = torchvision.models.get_model(name, num_classes=num_classes)
    if pretrained:
        path = torchvision_weights_file(name)
        head = head_of(model, lambda: torchvision.models.get_model(name, num_classes=num_classes + 1))
        load_weights(model, read_weights(path, "model.pretrained"), "model.pretrained", head)
    return model


def torchvision_weights_file(name: str) -> Path:
    """Where torch.hub keeps `name`'s default weights (`<torch.hub.get_dir()>/checkpoints/<file of the URL>`), or
    a one-line error saying where to put them: nothing is downloaded at run time."""
    import torchvision

    weights = torchvision.models.get_model_weights(name).DEFAULT
    path = Path(torch.hub.get_dir()) / "checkpoints" / weights.url.rsplit("/", 1)[-1]
    if not path.is_file():
        raise ConfigError(_not_cached(f"torchvision's {name} weights", path, weights.url))
    return path


def _not_cached(what: str, path: Path, url: str) -> str:
    return (
        f"model.pretrained=true: {what} are not at {path} and nothing is downloaded at run time; put {url} "
        f"there, or pass model.weights=<file>"
    )


class TinyCNN(nn.Module):
    """Two convolutions and a linear head: a second-scale model for tests."""

    def __init__(
        self, num_classes: int, in_channels: int = 3, width: Annotated[int, Positive] = 16, batch_norm: bool = True
    ):
        super().__init__()

        def block(cin: int, cout: int, stride: int) -> nn.Sequential:
            norm = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=not batch_norm), norm, nn.ReLU())

        self.features = nn.Sequential(block(in_channels, width, 1), block(width, 2 * width, 2))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def timm_classifier(
    name: str,
    num_classes: int,
    in_channels: int = 3,
    img_size: int | None = None,
    kwargs: Mapping | None = None,  # Mapping: a DictConfig passes src/config/schema.py
    pretrained: bool = False,
) -> nn.Module:
    """Any timm model, randomly initialised or (pretrained) from its default weights in the Hugging Face cache:
    nothing is downloaded. img_size is for the models that fix their input size (ViTs); kwargs go to
    timm.create_model (e.g. patch_size, drop_path_rate)."""
    try:
        import timm
    except ImportError:
        raise ConfigError("model=timm needs the timm package: pip install timm") from None
    if not timm.is_model(name):  # also False for hf-hub: names, which would download a config
        arch = name.split(":")[-1].split("/")[-1].split(".")[0]  # resnet18 of hf-hub:timm/resnet18.a1_in1k
        # a substring catches a partial name (vit_tiny; names that start with it first), difflib a typo (resnt18)
        close = sorted(timm.list_models(f"*{arch}*"), key=lambda m: not m.startswith(arch))[:6]
        close = close or difflib.get_close_matches(arch, timm.list_models(), n=6)
        hint = f"close names: {', '.join(close)}" if close else "timm.list_models('*part*') lists the names"
        if ":" in name:
            hint = f"hub names would download; name an architecture, e.g. {close[0] if close else 'resnet18'}"
        raise ConfigError(f"model.name={name!r} is not a timm model; {hint}")
    extra = dict(kwargs or {})
    taken = sorted({"pretrained", "num_classes", "in_chans"} & extra.keys())
    if taken:
        raise ConfigError(
            f"model.kwargs.{taken[0]} is set by ddplab (model.pretrained=true for weights; classes and channels "
            f"come from the data); remove it"
        )
    if img_size is not None:
        extra["img_size"] = img_size
    if pretrained:  # read here as plain data; timm adapts it (input channels, its own key changes, a new head)
        path, saved = timm_weights_file(name)
        extra["pretrained_cfg_overlay"] = {"state_dict": read_weights(path, "model.pretrained")}
        if saved.num_classes != num_classes:
            log.info("model.pretrained: %s", new_head_line(str(saved.classifier), num_classes, saved.num_classes))
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, in_chans=in_channels, **extra)
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        # a keyword this architecture does not take (e.g. img_size for a ResNet) is a config mistake
        raise ConfigError(f"model=timm model.name={name}: {exc}; drop that setting") from None


def timm_weights_file(name: str):
    """(the file of `name`'s default weights in the Hugging Face cache, their timm PretrainedCfg), or a one-line
    error saying where to put it: nothing is downloaded at run time."""
    import huggingface_hub
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name)
    if cfg is None or not cfg.hf_hub_id:
        raise ConfigError(
            f"model.pretrained=true: timm has no Hugging Face weights for {name}; pass model.weights=<file>"
        )
    repo, file = cfg.hf_hub_id, cfg.hf_hub_filename or "model.safetensors"
    found = huggingface_hub.try_to_load_from_cache(repo, file)
    if not isinstance(found, str):  # None, or a marker that the file is known to be absent
        # the cache's own layout: `snapshots/main/` is found without the refs a download writes
        cache = Path(huggingface_hub.constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}/snapshots/main"
        raise ConfigError(
            _not_cached(f"timm's {repo} weights", cache / file, f"https://huggingface.co/{repo}/resolve/main/{file}")
        )
    return Path(found), cfg


def read_weights(path, key: str = "model.weights") -> dict[str, torch.Tensor]:
    """A state dict file as plain tensors: safetensors, or a torch.save file read with weights_only (a ddplab
    checkpoint gives its model): never code (SECURITY.md)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{key}={path} does not exist; pass a state dict file (.pt, .pth, .bin or .safetensors)")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(f"{key}={path} needs the safetensors package: pip install safetensors") from None
        try:
            return load_file(path)
        except Exception as exc:
            raise ConfigError(f"{key}={path} is unreadable ({type(exc).__name__}: {str(exc)[:80]})") from None
    state = safe_torch_load(path, path)
    for entry in ("model", "state_dict"):  # a ddplab checkpoint, or a training script's {"state_dict": ...}
        if isinstance(state, dict) and isinstance(state.get(entry), dict):
            state = state[entry]
    if not (isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ConfigError(f"{key}={path} is not a state dict (names to tensors); save model.state_dict()")
    return state


def head_of(model: nn.Module, other: Callable[[], nn.Module]) -> set[str]:
    """The state-dict entries whose shape follows the class count (the classifier head): those that differ in
    `other()`, the same model built for one class more (on the meta device: no memory, no random draws)."""
    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        shapes = {k: v.shape for k, v in other().state_dict().items()}
    return {k for k, v in model.state_dict().items() if k in shapes and shapes[k] != v.shape}


def new_head_line(names: str, classes: int, saved: int | None = None) -> str:
    had = f" (the weights have {saved})" if saved else ""
    return f"a new head ({names}) for the data's {classes} classes, initialized afresh{had}"


def load_weights(model: nn.Module, state: dict, source: str, head: set[str]) -> None:
    """`state` into `model`; the head's entries are left as initialized where their shape differs (another class
    count), and said so in one line. Any other difference is a one-line error."""
    own = model.state_dict()
    new = sorted(k for k in head if k in state and k in own and state[k].shape != own[k].shape)
    saved_classes = state[new[0]].shape[0] if new else None
    state = {k: v for k, v in state.items() if k not in new}
    # older files (torchvision's ResNets) predate BatchNorm's step counter: it is kept as initialized
    counters = [k for k in own if k.endswith(".num_batches_tracked") and k not in state]
    check_compatible(
        {k: v.shape for k, v in state.items()},
        {k: v.shape for k, v in own.items() if k not in new and k not in counters},
        source,
        "pass weights of this model (model.name and its options)",
    )
    model.load_state_dict(state, strict=not (new or counters))
    if new:
        log.info("%s: %s", source, new_head_line(", ".join(new), own[new[0]].shape[0], saved_classes))


def apply_freeze(model: nn.Module, freeze, head: set[str]) -> tuple[int, int]:
    """model.freeze: parameters under these module-name prefixes (or all but the head: backbone) are not trained.
    Returns (frozen, all) parameter tensors."""
    names = [n for n, _ in model.named_parameters()]
    if freeze == "backbone":
        frozen = {n for n in names if n not in head}
    else:
        prefixes = [freeze] if isinstance(freeze, str) else list(freeze)
        for prefix in prefixes:
            if not any(n == prefix or n.startswith(prefix + ".") for n in names):
                children = ", ".join(n for n, _ in model.named_children())
                raise ConfigError(
                    f"model.freeze: {prefix!r} names no parameter of this model; its modules: {children} "
                    f"(a prefix like layer1 or layer1.0), or backbone (all but the head)"
                )
        frozen = {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}
    if len(frozen) == len(names):
        raise ConfigError(f"model.freeze={freeze} freezes every parameter: nothing would train; freeze fewer modules")
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return len(frozen), len(names)


def head_names(cfg, model: nn.Module, num_classes: int, in_channels: int) -> set[str]:
    """The head of `model`, built from `cfg` (see head_of)."""
    return head_of(model, lambda: build_model(cfg, num_classes + 1, in_channels, start=False))


def preflight(cfg) -> None:
    """Before any process starts: the starting point's files are there and model.freeze names this model's
    modules (it is built on the meta device; the class and channel counts do not change module names)."""
    if cfg.get("pretrained"):
        name, target = cfg.name, cfg._target_.rsplit(".", 1)[-1]
        {"torchvision_classifier": torchvision_weights_file, "timm_classifier": timm_weights_file}[target](name)
    if cfg.get("weights") and not Path(cfg.weights).is_file():
        read_weights(cfg.weights)  # its one-line error
    if cfg.get("freeze"):
        with torch.device("meta"):
            model = build_model(cfg, 10, 3, start=False)
            apply_freeze(model, cfg.freeze, head_names(cfg, model, 10, 3))


def build_model(cfg, num_classes: int, in_channels: int, start: bool = True) -> nn.Module:
    """The model of `cfg` for this data; with `start`, from its starting point (model.pretrained, model.weights)
    and with model.freeze applied, else the architecture alone (randomly initialised)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    arch = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in declared(ModelStart)])
    if not start and arch.get("pretrained"):
        arch.pretrained = False
    try:
        model = instantiate(arch, num_classes=num_classes, in_channels=in_channels)
    except InstantiationException as exc:
        # Hydra wraps a builder's error in a 5-line message; a bad model setting should stay ddplab's one line
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
    if not start:
        return model
    head = head_names(cfg, model, num_classes, in_channels) if cfg.get("weights") or cfg.get("freeze") else set()
    if cfg.get("weights"):
        load_weights(model, read_weights(cfg.weights), f"model.weights={cfg.weights}", head)
    if cfg.get("freeze"):
        frozen, count = apply_freeze(model, cfg.freeze, head)
        log.info("model.freeze=%s: %d of %d parameter tensors are not trained", _listed(cfg.freeze), frozen, count)
    return model


def _listed(value) -> str:
    return value if isinstance(value, str) else f"[{','.join(value)}]"
