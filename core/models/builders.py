"""Networks from outside the project: a user's own builder (``model.arch: package.module:function``) and the
classifier of any network (found, resized, replaced).

A builder is imported from the workspace (the current directory) or ``PYTHONPATH`` and called with no
arguments, or with ``num_classes`` when it takes that keyword; it must return an ``nn.Module``
(``torchvision.models:resnet50`` is one). The classifier is the module timm's ``pretrained_cfg`` names
(``"classifier"``) or else the network's last ``nn.Linear``; changing the number of classes replaces that
module by a new ``nn.Linear`` and keeps everything else (T-CNN, d'Ascoli et al. 2021, Sec. 3 fine-tunes
ImageNet CNNs; a 10-class dataset needs a 10-way head).
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "TORCHVISION_PREFIX",
    "build_external",
    "classifier",
    "is_builder",
    "load_builder",
    "set_num_classes",
]

#: Builders of this module are torchvision's (ImageNet statistics, `core.models.importing`).
TORCHVISION_PREFIX = "torchvision.models"


def is_builder(arch: str) -> bool:
    """``arch`` names a user's builder (``module:function``), not a timm or project arch."""
    return ":" in arch


def load_builder(arch: str) -> Callable[..., nn.Module]:
    """The function ``arch`` = ``package.module:function`` names, imported from the workspace or PYTHONPATH;
    a one-line ValueError when it cannot be imported or is not callable."""
    module_name, _, attr = arch.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{arch!r} is not of the form package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:  # the workspace, as `python -m` would have it
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or the module's own code failing: one line either way
        raise ValueError(f"cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise ValueError(f"{arch!r} is not callable")
    return fn  # type: ignore[return-value]


def _takes(fn: Callable[..., Any], name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def build_external(arch: str, num_classes: int | None = None, in_chans: int | None = None) -> nn.Module:
    """The network of the builder ``arch``, with a ``num_classes``-way classifier when given (passed to the
    builder when it takes ``num_classes``, else its classifier replaced) and checked to take ``in_chans``
    input channels. One-line ValueErrors."""
    fn = load_builder(arch)
    kwargs = {"num_classes": num_classes} if num_classes is not None and _takes(fn, "num_classes") else {}
    try:
        model = fn(**kwargs)
    except Exception as err:
        raise ValueError(f"{arch} failed ({type(err).__name__}: {err})") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{arch} returned {type(model).__name__}, not a torch nn.Module")
    if num_classes is not None:
        set_num_classes(model, num_classes)
    if in_chans is not None:
        first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
        if first is not None and first.in_channels != in_chans:
            raise ValueError(f"{arch} takes {first.in_channels}-channel images, the dataset has {in_chans}")
    return model


def classifier(model: nn.Module) -> tuple[str, nn.Linear]:
    """(name, module) of the network's classifier: the module timm's ``pretrained_cfg["classifier"]`` names,
    else the last ``nn.Linear``; a ValueError when there is none."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    name = cfg.get("classifier") if isinstance(cfg, dict) else None
    if isinstance(name, str):
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if isinstance(module, nn.Linear):
            return name, module
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier")
    return linears[-1]


def set_num_classes(model: nn.Module, num_classes: int, seed: int | None = None) -> bool:
    """Give ``model`` a ``num_classes``-way classifier in place (a new ``nn.Linear`` on the same features,
    torch's default init drawn from ``seed`` when given); False when it has that many already."""
    name, head = classifier(model)
    if head.out_features == num_classes:
        return False
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        new = nn.Linear(head.in_features, num_classes, bias=head.bias is not None)
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)
    if getattr(model, "num_classes", None) is not None:
        model.num_classes = num_classes
    return True
