"""A pretrained CNN from anywhere, as the T-CNN's starting point (T-CNN, d'Ascoli et al. 2021: "transition
smoothly from any pretrained CNN to its functionally identical hybrid model"; Table 2 fine-tunes released
ResNet-RS checkpoints).

Three ways in (``model.arch`` with ``pretrain.source``):
- a timm name (or a project net) with a checkpoint file: a timm state dict or ``.safetensors``, a torchvision
  ResNet state dict (timm's ResNets use torchvision's parameter names), or a training script's dict holding
  the state dict under ``state_dict`` or ``model``; read by timm's own ``load_state_dict`` (which also
  strips DataParallel's ``module.`` prefix and prefers EMA weights where a timm checkpoint has them);
- a timm name with ``weights: timm``: timm's own pretrained weights (``pretrained=True``; a download);
- ``package.module:function``: a user's own builder (`core.models.builders`) with a checkpoint file.

The weights load strictly (every key and shape must fit; the one tolerance is BatchNorm's
``num_batches_tracked``, which releases of older PyTorch lack and BatchNorm fills in). A checkpoint with
another number of classes than the dataset keeps its features and gets a new classifier
(`core.models.builders.set_num_classes`, drawn from a seed derived from the file's sha256, so every seed of
a sweep shares one import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import timm
import torch
import torch.nn as nn

from core.models.builders import TORCHVISION_PREFIX, classifier, is_builder, set_num_classes
from core.utils.errors import first_line
from core.utils.hashing import derive_seed, file_digest

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Imported",
    "ImportError_",
    "check_source",
    "import_cnn",
    "normalization",
    "read_weights",
]

#: torchvision's ImageNet statistics (its models' documented preprocessing); timm's IMAGENET_DEFAULT_* agree.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImportError_(ValueError):  # noqa: N801 - not the builtin ImportError
    """The source cannot be imported: one line naming the file and what does not fit."""


@dataclass
class Imported:
    """An imported CNN and what the import did to it."""

    model: nn.Module
    sha256: str | None
    classifier: str  # the classifier's module name
    source_classes: int  # classes of the checkpoint's classifier
    head_replaced: bool
    notes: list[str] = field(default_factory=list)


def _timm_cfg(arch: str) -> dict[str, Any]:
    if is_builder(arch) or not timm.is_model(arch):
        return {}
    try:
        cfg = timm.models.get_pretrained_cfg(arch)
    except Exception:  # an arch without a pretrained cfg (the project's small nets)
        return {}
    return cfg.to_dict() if cfg is not None else {}


def size_note(arch: str, image_size: int) -> str | None:
    """A note when the net's pretrained config names another input size than the one it runs at here (timm's
    ``pretrained_cfg.input_size``; a builder's size is unknown): its accuracy need not be the one reported."""
    size = (_timm_cfg(arch).get("input_size") or [None])[-1]
    if size is None or size == image_size:
        return None
    return (f"{arch} was trained at {size} px (its pretrained config's input_size) and runs here at {image_size} "
            "px (data.image_size): its accuracy need not match the one reported for it")  # fmt: skip


def normalization(arch: str, source: Any) -> dict[str, Any]:
    """The input normalization the checkpoint expects: ``pretrain.source.mean/std`` when given, else timm's
    ``pretrained_cfg`` (mean, std, input size), else torchvision's ImageNet statistics for a torchvision builder;
    None for a user's own builder without them (`check_source` refuses that)."""
    if source.mean is not None:
        return {"mean": list(source.mean), "std": list(source.std), "from": "pretrain.source"}
    if is_builder(arch):
        if arch.startswith(TORCHVISION_PREFIX + ":"):
            return {"mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "from": "torchvision (ImageNet)"}
        return {}
    cfg = _timm_cfg(arch)
    if "mean" in cfg and "std" in cfg:
        return {"mean": list(cfg["mean"]), "std": list(cfg["std"]), "from": "timm pretrained_cfg",
                "input_size": list(cfg.get("input_size") or [])}  # fmt: skip
    return {}


def check_source(arch: str, source: Any) -> None:
    """What params validation can say about ``pretrain.source`` before any compute (one-line ValueError)."""
    if not source.is_file:
        if is_builder(arch) or not timm.is_model(arch) or not timm.models.is_model_pretrained(arch):
            raise ValueError(f"pretrain.source.weights: timm has no pretrained weights for {arch!r}")
        return
    if not normalization(arch, source):
        raise ValueError(
            f"pretrain.source.mean: {arch!r} is a user's builder: give mean and std (the normalization it was "
            "trained with)"
        )


def read_weights(path: str | Path, sha256: str) -> dict[str, torch.Tensor]:
    """The state dict of the checkpoint file at ``path``, after its sha256 is checked (timm's loader: state
    dict or safetensors, ``state_dict`` / ``model`` wrappers, ``module.`` prefixes removed)."""
    path = Path(path)
    if not path.is_file():
        raise ImportError_(f"pretrain.source.weights: {path}: no such file")
    got = file_digest(path)
    if got != sha256:
        raise ImportError_(f"pretrain.source.weights: {path}: sha256 {got} does not match pretrain.source.sha256 "
                           f"{sha256}")  # fmt: skip
    try:
        state = timm.models.load_state_dict(str(path), use_ema=True, weights_only=True)
    except Exception as err:  # truncated zip, not a pickle, unsafe globals, bad safetensors header
        raise ImportError_(
            f"pretrain.source.weights: {path}: not a readable checkpoint ({first_line(err)})"
        ) from None
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(v, torch.Tensor) for v in state.values())
    ):
        raise ImportError_(f"pretrain.source.weights: {path}: holds no state dict of tensors ({_holds(state)}); "
                           f"accepted: a state dict, or one under {' / '.join(WRAPPER_KEYS)} (re-save the one "
                           "your checkpoint holds: torch.save(ckpt[KEY], 'weights.pth'))")  # fmt: skip
    return state


#: The keys timm's loader unwraps a state dict from (timm.models.load_state_dict, use_ema=True).
WRAPPER_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")


def _holds(obj: object, shown: int = 8) -> str:
    """What a checkpoint that is no state dict holds: its top-level keys (non-tensor values marked)."""
    if not isinstance(obj, dict):
        return f"a {type(obj).__name__}"
    if not obj:
        return "an empty dict"
    keys = [
        f"{k!r}" + ("" if isinstance(v, torch.Tensor) else f" ({type(v).__name__})") for k, v in obj.items()
    ]
    more = f", ... {len(keys) - shown} more" if len(keys) > shown else ""
    return f"its top-level keys: {', '.join(keys[:shown])}{more}"


def _fit_message(model: nn.Module, state: dict[str, torch.Tensor], arch: str) -> str | None:
    """Why ``state`` does not load strictly into ``model`` (None: it does): the first missing and unexpected
    keys with their counts, or the first shape that differs."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first {missing[0]!r})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first {unexpected[0]!r})")
        return f"keys do not fit {arch}: {', '.join(parts)}"
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            return f"shape of {k!r} is {tuple(v.shape)} in the file, {tuple(own[k].shape)} in {arch}"
    return None


def import_cnn(
    arch: str, source: Any, num_classes: int, in_chans: int, options: dict[str, Any] | None = None
) -> Imported:
    """The CNN ``arch`` with the weights of ``source`` (`SourceConfig`), holding a ``num_classes``-way classifier.

    The untrained network is what `core.models.build` makes of kind "cnn" (the network pretraining would
    train); the checkpoint's classifier size is read from the file, and when it differs from ``num_classes``
    the classifier is replaced.
    """
    from core.models.factory import (
        build,
    )  # the package's factory (imported here: the package imports its peers)

    options = dict(options or {})
    if source.is_file:
        sha = source.sha256
        state = read_weights(source.weights, sha)
        try:
            model = build("cnn", arch, num_classes, in_chans=in_chans, **options)
        except (ValueError, TypeError, RuntimeError) as err:
            raise ImportError_(f"model.arch: cannot build {arch!r} ({first_line(err)})") from None
    else:  # timm's own weights: timm.create_model(pretrained=True) downloads and loads them (strictly)
        sha = None
        try:
            model = timm.create_model(arch, pretrained=True, in_chans=in_chans, **options)
        except Exception as err:
            raise ImportError_(f"pretrain.source.weights: timm cannot load its weights for {arch!r} "
                               f"({first_line(err)})") from None  # fmt: skip
        state = model.state_dict()
    try:
        head_name, head = classifier(model)
    except ValueError as err:
        raise ImportError_(f"model.arch: {err}") from None
    source_classes = (
        int(state[f"{head_name}.weight"].shape[0]) if f"{head_name}.weight" in state else head.out_features
    )
    set_num_classes(model, source_classes)
    problem = _fit_message(model, state, arch)
    if problem is not None:
        raise ImportError_(f"pretrain.source.weights: {source.weights}: {problem}")
    model.load_state_dict(
        state, strict=False
    )  # strict in effect: _fit_message allowed only num_batches_tracked
    notes = []
    replaced = set_num_classes(model, num_classes, seed=derive_seed(0, f"classifier:{sha or arch}"))
    if replaced:
        notes.append(f"classifier {head_name!r} replaced: {source_classes} classes in the checkpoint, "
                     f"{num_classes} in the dataset (a new nn.Linear; every other weight kept)")  # fmt: skip
    return Imported(model, sha, head_name, source_classes, replaced, notes)
