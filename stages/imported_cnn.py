"""A pretrained CNN imported instead of trained (`pretrain.source`: a user's weights file or timm's own weights,
`core.models.importing`), for the pretrain stage: its identity, the check of its weights file, and the import
itself, which writes what a trained CNN leaves -- ``cnn-final.pt``, the one checkpoint at t1 = 0 that reparam
converts into a T-CNN ([TCNN21] Sec. 2) and the control starts from, an empty history, and metrics naming the
source, its sha256 and the normalization every stage then feeds it with.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from core.config import Params, SourceConfig
from core.models import importing
from core.training.environment import deterministic
from stages.harness import chain
from stages.harness import training as T
from stages.harness.identity import stage_identity
from stages.harness.pretraining import NAME, checkpoint_epochs, model_spec, network_code
from stages.harness.runner import StageError


def import_identity(
    params: Params, spec: dict[str, Any], data_fingerprint: str, device: str
) -> dict[str, Any]:
    """An import's identity: the network (``spec``), the weights (their sha256, or timm's name for its own),
    the normalization and the data it is evaluated on -- not the seed (the imported weights, and a replaced
    classifier's init, do not depend on it), so every seed of a sweep shares one import. Its validation
    accuracy is measured on the validation split of the first seed that ran it (``val_split_seed``)."""
    source = params.pretrain.source
    assert source is not None
    parts = {
        "model": {"spec": spec},
        "source": {"sha256": source.sha256} if source.is_file else {"timm": params.model.arch},
        "normalization": importing.normalization(params.model.arch, source),
        "data": {k: v for k, v in T.data_identity(params).items() if k not in ("sample_fraction",)},
    }
    return stage_identity(NAME, parts, inputs={"data": data_fingerprint}, device=device)


def check_source(source: SourceConfig) -> None:
    """A weights file has the sha256 params give (read again where it is loaded); timm's own weights: nothing
    to check before the run."""
    if source.is_file:
        try:
            importing.read_weights(source.weights, source.sha256 or "")
        except ValueError as err:
            raise StageError(str(err)) from None


def import_cnn(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Import the pretrained CNN of ``pretrain.source`` instead of training one (`core.models.importing`):
    verify the file, build the net, load the weights strictly (a new classifier when the class counts differ),
    evaluate it on the validation and test splits, and write what a trained CNN leaves: ``cnn-final.pt``, the
    t1 = 0 checkpoint reparam converts and the control starts from, history (empty) and metrics."""
    t_wall = time.perf_counter()
    root = Path(root)
    source = params.pretrain.source
    assert source is not None
    ds = T.datasets(params, root)
    spec = model_spec(params, ds.num_classes, ds.in_chans)
    try:
        imported = importing.import_cnn(params.model.arch, source, ds.num_classes, ds.in_chans,
                                        params.model.record.backbone_options(params.model.options))  # fmt: skip
    except ValueError as err:
        raise StageError(str(err)) from None
    t_import = time.perf_counter() - t_wall
    if note := importing.size_note(params.model.arch, params.data.image_size):
        imported.notes.append(note)
    for note in imported.notes:
        print(f"{NAME}: {note}", file=sys.stderr)
    model, device = imported.model, T.training_device()
    channels_last = T.use_channels_last(device)
    model.to(device)
    loaders = T.loaders(ds, batch_size=T.EVAL_BATCH, seed=params.cnn_seed, augment=None,
                        size=params.data.image_size, num_workers=params.data.num_workers)  # fmt: skip
    with deterministic(device):
        val = T.evaluate_split(model, loaders.val, device, channels_last, params) if loaders.val else {}
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)
    origin = {"weights": source.weights, "sha256": imported.sha256, "arch": params.model.arch,
              "classifier": imported.classifier, "source_classes": imported.source_classes,
              "head_replaced": imported.head_replaced}  # fmt: skip
    extra = {**T.extra_state(spec, ds, params.data.image_size), "source": origin,
             "network_code": network_code(params)}  # fmt: skip
    state = {"kind": "model", "model": T.cpu_state(model), **extra, "epoch": params.t1(), "global_step": 0}
    metrics = {
        "imported": True,
        "source": origin,
        "normalization": T.input_normalization(params),
        "notes": imported.notes,
        "val_loss": val.get("loss"),
        "val_acc": val.get("acc"),
        "val_split_seed": params.cnn_seed,
        "data_roles": ds.roles,  # which images validated and tested (core.data.split_roles)
        "test_loss": test["loss"],
        "test_acc": test["acc"],
        "epochs": 0,
        "checkpoint_epochs": checkpoint_epochs(params),
        "params_count": sum(t.numel() for t in model.parameters()),
        "device": device.type,
        "import_s": t_import,
        "wall_s": time.perf_counter() - t_wall,
    }
    T.publish(
        None,
        root / chain.run_dir(NAME),
        stale_glob="ckpt/ckpt-epoch-*.pt",
        objects={f"ckpt/ckpt-epoch-{params.t1():03d}.pt": state, "cnn-final.pt": state},
        history=[],
        metrics=metrics,
    )
    return metrics
