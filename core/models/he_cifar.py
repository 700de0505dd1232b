"""The CIFAR-10 ResNets of He et al. 2016, "Deep Residual Learning for Image Recognition", Sec. 4.2.

A 3x3 convolution of 16 channels, then three stages (``layer1``, ``layer2``, ``layer3``) of n BasicBlocks
each (two 3x3 convolutions with batch norm) with 16, 32 and 64 channels on 32x32, 16x16 and 8x8 maps (the
first block of ``layer2`` and ``layer3`` strides 2), global average pooling and a linear classifier
(``linear``); depth 6n + 2, so n = 3, 5, 7, 9 gives ResNet-20, -32, -44 and -56 (Table 6: 0.27M, 0.46M,
0.66M and 0.85M parameters).

Shortcuts are the paper's option A: the identity, or, where the shape changes, the input subsampled by 2 in
space (``x[:, :, ::2, ::2]``) and zero-padded in channels; they hold no parameters. Convolution and linear
weights get He et al. 2015's init (``kaiming_normal_``).

Parameter and buffer names match the checkpoints released with akamaster/pytorch_resnet_cifar10 once their
``module.`` prefix is stripped, so those load with ``load_state_dict(strict=True)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "BasicBlock",
    "CifarResNet",
    "OptionAShortcut",
    "cifar_resnet",
    "resnet20",
    "resnet32",
    "resnet44",
    "resnet56",
]


class OptionAShortcut(nn.Module):
    """Option-A shortcut (He et al. 2016, Sec. 3.3 / 4.2): subsample by ``stride`` in space, then zero-pad
    the channels from ``in_planes`` to ``planes`` (``(planes - in_planes) // 2`` on each side). No parameters."""

    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        if planes < in_planes or (planes - in_planes) % 2:
            raise ValueError(f"option A pads channels evenly: cannot go from {in_planes} to {planes}")
        self.stride = stride
        self.pad = (planes - in_planes) // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad, self.pad))

    def extra_repr(self) -> str:
        return f"stride={self.stride}, pad={self.pad}"


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a parameter-free shortcut: relu(bn2(conv2(relu(bn1(conv1 x))))
    + shortcut(x))."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut: nn.Module
        if stride != 1 or in_planes != planes:
            self.shortcut = OptionAShortcut(in_planes, planes, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al. 2016, Sec. 4.2 CIFAR ResNet with ``n`` BasicBlocks per stage (depth 6n + 2)."""

    def __init__(self, n: int, num_classes: int = 10) -> None:
        super().__init__()
        if n < 1:
            raise ValueError(f"need at least one block per stage, got n={n}")
        self.depth = 6 * n + 2
        self.num_classes = num_classes
        self.conv1 = nn.Conv2d(3, 16, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self._in_planes = 16
        self.layer1 = self._make_stage(16, n, stride=1)
        self.layer2 = self._make_stage(32, n, stride=2)
        self.layer3 = self._make_stage(64, n, stride=2)
        self.linear = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def _make_stage(self, planes: int, n: int, stride: int) -> nn.Sequential:
        blocks = []
        for s in [stride] + [1] * (n - 1):
            blocks.append(BasicBlock(self._in_planes, planes, s))
            self._in_planes = planes
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def cifar_resnet(depth: int, num_classes: int = 10) -> CifarResNet:
    """The CIFAR ResNet of the given depth (6n + 2: 20, 32, 44, 56, 110, ...)."""
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"depth must be 6n + 2 with n >= 1, got {depth}")
    return CifarResNet((depth - 2) // 6, num_classes=num_classes)


def resnet20(num_classes: int = 10) -> CifarResNet:
    """ResNet-20 (n = 3; 0.27M parameters)."""
    return cifar_resnet(20, num_classes)


def resnet32(num_classes: int = 10) -> CifarResNet:
    """ResNet-32 (n = 5; 0.46M parameters)."""
    return cifar_resnet(32, num_classes)


def resnet44(num_classes: int = 10) -> CifarResNet:
    """ResNet-44 (n = 7; 0.66M parameters)."""
    return cifar_resnet(44, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    """ResNet-56 (n = 9; 0.85M parameters)."""
    return cifar_resnet(56, num_classes)
