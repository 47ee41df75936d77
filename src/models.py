"""The `model/` group. Every builder takes num_classes and in_channels from the data."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Annotated

import torch
from torch import nn

from src.config.errors import ConfigError
from src.config.schema import Positive, PositiveReal


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


def torchvision_classifier(name: str, num_classes: int, in_channels: int = 3) -> nn.Module:
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
    return torchvision.models.get_model(name, num_classes=num_classes)


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
    name: str, num_classes: int, in_channels: int = 3, img_size: int | None = None, kwargs: Mapping | None = None
) -> nn.Module:  # Mapping: a DictConfig passes src/config/schema.py
    """Any timm model, randomly initialised (pretrained=False: nothing is downloaded). img_size is for the
    models that fix their input size (ViTs); kwargs go to timm.create_model (e.g. patch_size, drop_path_rate)."""
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
            f"model.kwargs.{taken[0]} is set by ddplab (random init; classes and channels come "
            f"from the data); remove it"
        )
    if img_size is not None:
        extra["img_size"] = img_size
    try:
        return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=in_channels, **extra)
    except TypeError as exc:
        if "unexpected keyword argument" not in str(exc):
            raise
        # a keyword this architecture does not take (e.g. img_size for a ResNet) is a config mistake
        raise ConfigError(f"model=timm model.name={name}: {exc}; drop that setting") from None


def build_model(cfg, num_classes: int, in_channels: int) -> nn.Module:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(cfg, num_classes=num_classes, in_channels=in_channels)
    except InstantiationException as exc:
        # Hydra wraps a builder's error in a 5-line message; a bad model setting should stay ddplab's one line
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, ConfigError):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None
