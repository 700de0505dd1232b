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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.utils.module_files import local_files

if TYPE_CHECKING:  # torch loads where a network is built or changed, not where a name is checked (the CLI)
    import torch.nn as nn

__all__ = [
    "PROJECT_PACKAGES",
    "TORCHVISION_PREFIX",
    "build_external",
    "builder_module",
    "check_code",
    "classifier",
    "code_to_cover",
    "is_builder",
    "load_builder",
    "set_num_classes",
]

#: Builders of this module are torchvision's (ImageNet statistics, `core.models.importing`).
TORCHVISION_PREFIX = "torchvision.models"
#: The project's own code folders: dvc.yaml lists what the stages import from them.
PROJECT_PACKAGES = ("core", "stages")


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


def builder_module(arch: str) -> str:
    """The module of the builder ``arch`` (``package.module`` of ``package.module:function``)."""
    return arch.partition(":")[0]


def code_to_cover(arch: str, workspace: Path) -> list[str]:
    """The files of the builder ``arch`` inside ``workspace`` that ``model.code`` must hold, relative to it: its
    module and the workspace files it runs outside the project's own packages (its package's ``__init__``,
    the local modules it imports: `core.utils.module_files.local_files`), its module first; none for an
    installed module."""
    load_builder(arch)
    workspace = workspace.resolve()
    own = Path(sys.modules[builder_module(arch)].__file__ or "").resolve()
    files = [f for f in local_files(builder_module(arch)) if f.is_relative_to(workspace)]
    others = [f for f in files if f != own and f.relative_to(workspace).parts[0] not in PROJECT_PACKAGES]
    return [str(f.relative_to(workspace)) for f in ([own] if own in files else []) + others]


def _covered(rel: str, code: Path) -> bool:
    return Path(rel) == code or code in Path(rel).parents


def check_code(arch: str, code: Path, workspace: Path | None = None) -> None:
    """``model.code`` (``code``: a file or folder, relative to ``workspace``, the working directory by default)
    holds every workspace file of the builder ``arch`` (`code_to_cover`): it is a DVC dependency of each stage
    that builds the network, so an edit of the builder reruns them. Else a one-line ValueError naming the value
    to set."""
    workspace = (workspace or Path.cwd()).resolve()
    files = code_to_cover(arch, workspace)
    rel = Path(os.path.relpath((workspace / code).resolve(), workspace))
    outside = [f for f in files if not _covered(f, rel)]
    if not outside:
        return
    common = files[0] if len(files) == 1 else os.path.commonpath(files)
    fix = (
        f"set model.code: {common}"
        if common not in ("", ".")
        else "keep them in one folder and set model.code to it"
    )
    raise ValueError(
        f"{code} does not hold {outside[0]}, code of model.arch {arch} (model.code is a DVC dependency of the "
        f"stages that build the network, so that an edit of it reruns them): {fix}"
    )


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
    import torch.nn as nn

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
    import torch.nn as nn

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
    import torch
    import torch.nn as nn

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
