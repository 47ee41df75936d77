"""The `model/` group. Every builder takes num_classes and in_channels from the data."""
from __future__ import annotations

import torch
from torch import nn

from src.config import ConfigError


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

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 64, logit_scale: float = 0.125):
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
        raise ConfigError(f"model.name={name!r} is not a torchvision classifier; e.g. one of "
                          f"{', '.join(sorted(available)[:12])}, ...")
    if in_channels != 3:
        raise ConfigError(f"model=torchvision expects 3-channel images but the data has {in_channels}; "
                          f"use model=resnet18 or model=tiny_cnn")
    return torchvision.models.get_model(name, num_classes=num_classes)


class TinyCNN(nn.Module):
    """Two convolutions and a linear head: a second-scale model for tests."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16, batch_norm: bool = True):
        super().__init__()

        def block(cin: int, cout: int, stride: int) -> nn.Sequential:
            norm = nn.BatchNorm2d(cout) if batch_norm else nn.Identity()
            return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=not batch_norm), norm, nn.ReLU())

        self.features = nn.Sequential(block(in_channels, width, 1), block(width, 2 * width, 2))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def build_model(cfg, num_classes: int, in_channels: int) -> nn.Module:
    from hydra.utils import instantiate

    return instantiate(cfg, num_classes=num_classes, in_channels=in_channels)
