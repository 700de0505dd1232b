"""Stage `pretrain`: train the CNN (SGD + momentum, warmup then per-step cosine over `pretrain.epochs`).

Outputs (under `root/runs/pretrain/`, published only when the run completes):
  ckpt/ckpt-epoch-XXX.pt  full training state after XXX epochs, for every t1 the config or a sweep asks for
                      (reparam.epoch, pretrain.checkpoint_epochs, sweep.grid["reparam.epoch"], and the last)
  cnn-final.pt        the trained CNN (model checkpoint: model + model_spec + normalization)
  history.csv/.json   per epoch: lr, train/val loss and accuracy, images/s
  metrics.json        final train/val/test loss and accuracy, timings

With `pretrain.source` the stage imports the CNN instead (`import_cnn`, `core.models.importing`): the same
outputs, its one checkpoint at t1 = 0, an empty history, and metrics naming the source, its sha256 and the
normalization every stage then feeds it with.

While running, state lives in `root/runs/.partial/pretrain/` (outside DVC's outs, which DVC deletes before a
stage runs); a rerun with the same params and data resumes from it exactly (see core.training.loop.fit).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from core.config import Params
from core.data import Datasets
from core.models import importing
from core.models.factory import backbone_options, set_stochastic_depth
from core.models.spec import build_from_spec, pretraining_spec
from core.training import distributed as D
from core.training.loop import (
    FitResult,
    TrainLoss,
    deterministic,
    fit,
    seed_everything,
)
from core.training.optim import WarmupCosine, build_sgd, param_groups
from core.utils.hashing import stable_hash
from stages.harness import chain
from stages.harness import training as T
from stages.harness.identity import network_code, stage_identity
from stages.harness.runner import StageError, stage_main

NAME = "pretrain"


def checkpoint_epochs(params: Params) -> list[int]:
    """Every t1 a run of this config may need: reparam.epoch, pretrain.checkpoint_epochs, the values of
    sweep.grid["reparam.epoch"], and the final epoch (in range 0..pretrain.epochs; 0 = the init); an
    imported CNN: its one state, t1 = 0 (`Params.t1`)."""
    if params.imports_cnn:
        return [params.t1()]
    wanted = {params.reparam.epoch, params.pretrain.epochs, *params.pretrain.checkpoint_epochs}
    wanted.update(int(v) for v in params.sweep.grid.get("reparam.epoch", []))
    return sorted(e for e in wanted if 0 <= e <= params.pretrain.epochs)


def model_spec(params: Params, num_classes: int, in_chans: int) -> dict[str, Any]:
    """The spec of the network this config pretrains (`core.models.spec.pretraining_spec`)."""
    m = params.model
    return pretraining_spec(m.record, m.arch, m.options, num_classes, in_chans, params.data.image_size)


def gate_lr(params: Params) -> float | None:
    """A kind that pretrains gated attention (hybrid_scratch) trains its gates at finetune.gate_lr (the
    fine-tuning recipe's gate lr, [TCNN21] Sec. 3); other kinds: one lr for every parameter."""
    return params.finetune.gate_lr if params.model.record.pretrains_attention else None


def identity(
    params: Params, spec: dict[str, Any], data_fingerprint: str, device: str, workers: int | None = None
) -> dict[str, Any]:
    """What pretraining's result depends on (`stages.harness.identity`): the seed, the data's meaning and content, the
    network it trains (``spec``, `model_spec`: kinds cnn, tcnn and psa pretrain the same CNN) with its
    drop_path, the pretrain section and its effective augmentation, and the gate lr the stage derives. Which
    epochs are kept is not part of it (a sweep's group keeps every t1 its trials need); the resume hash
    adds it."""
    if params.imports_cnn:
        return import_identity(params, spec, data_fingerprint, device)
    pre = {
        k: v for k, v in T.section_identity(params.pretrain).items() if k not in ("checkpoint_epochs", "seed")
    }
    parts: dict[str, Any] = {
        "seed": params.cnn_seed,
        "data": T.data_identity(params),
        "model": {"spec": spec, "drop_path": params.model.drop_path},
        "pretrain": pre,
        "augment": params.augment_for(NAME).model_dump(mode="json"),
    }
    if gate_lr(params) is not None:
        parts["gate_lr"] = gate_lr(params)
    inputs = {"data": data_fingerprint}
    execution = T.execution_identity(params, workers)
    return stage_identity(NAME, parts, inputs=inputs, device=device, execution=execution)


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


def _network_code(params: Params) -> dict[str, str]:
    """The pretraining network's code that dvc.yaml does not list (`stages.harness.identity.network_code`)."""
    return network_code(NAME, params.model.record.pretraining_record().code())


def run_hash(params: Params, spec: dict[str, Any], data_fingerprint: str, device: str) -> str:
    """The resume identity of a run: :func:`identity` and the epochs it keeps."""
    return stable_hash(
        {**identity(params, spec, data_fingerprint, device), "keep": checkpoint_epochs(params)}
    )


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Pretrain the CNN that reparam converts into a T-CNN at epoch t1 ([TCNN21]), resuming an interrupted run
    of the same identity, and publish its checkpoints, history and metrics; an imported CNN: `import_cnn`."""
    if params.imports_cnn:
        return import_cnn(params, root=root)
    t_wall = time.perf_counter()
    root = Path(root)
    out_dir, work_dir = root / chain.run_dir(NAME), root / chain.partial_dir(NAME)
    p = params.pretrain
    device = T.training_device()
    ds = T.datasets(params, root)
    keep = checkpoint_epochs(params)

    seed_everything(params.cnn_seed)
    spec = model_spec(params, ds.num_classes, ds.in_chans)
    model = _build_model(params, spec)
    image_size = params.data.image_size
    augment = params.augment_for(NAME)
    loaders, spe = _loaders(params, ds, augment)
    optimizer, scheduler = _optimization(params, model, spe)
    channels_last = T.use_channels_last(device)
    extra = {**T.extra_state(spec, ds, image_size), "network_code": _network_code(params)}

    with deterministic(device):
        result = fit(
            model,
            optimizer,
            scheduler,
            loaders.train,
            epochs=range(0, p.epochs),
            work_dir=work_dir,
            run_hash=run_hash(params, spec, ds.fingerprint, device.type),
            loss_fn=TrainLoss(augment.label_smoothing),
            val_loader=loaders.val,
            device=device,
            channels_last=channels_last,
            precision=params.precision,
            checkpoint_every_steps=T.checkpoint_every_steps(params, NAME),
            epoch_checkpoints=keep,
            extra_state=extra,
            desc=NAME,
        )
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)

    metrics = _metrics(params, ds, model, result, test, keep, device, t_wall)
    _publish(work_dir, out_dir, model, extra, result, metrics)
    return metrics


def _build_model(params: Params, spec: dict[str, Any]) -> torch.nn.Module:
    """The network of ``spec`` (a bad model section: one-line StageError), with ``model.drop_path``'s
    stochastic depth."""
    try:
        model = build_from_spec(spec)
    except (ValueError, TypeError) as err:
        raise StageError(f"model: cannot build {params.model.arch!r} ({err})") from None
    set_stochastic_depth(model, params.model.drop_path)
    return model


def _loaders(params: Params, ds: Datasets, augment: Any) -> tuple[T.Loaders, int]:
    """The train, validation and test loaders at ``pretrain.batch_size``, and the optimizer steps per epoch
    (a batch size above the training set: StageError)."""
    p = params.pretrain
    loaders = T.loaders(
        params,
        ds,
        batch_size=p.batch_size,
        seed=params.cnn_seed,
        augment=augment,
        size=params.data.image_size,
    )
    spe = len(loaders.train)
    if spe == 0:
        raise StageError(
            f"pretrain.batch_size: {p.batch_size} exceeds the {len(ds.train_y)} training images (no full batch)"
        )
    return loaders, spe


def _optimization(params: Params, model: torch.nn.Module, spe: int) -> tuple[torch.optim.SGD, WarmupCosine]:
    """SGD with momentum, and its schedule: linear warmup over ``pretrain.warmup_epochs``, then a per-step
    cosine to the last of ``pretrain.epochs`` (``spe``: steps per epoch)."""
    p = params.pretrain
    if gate_lr(params) is None:
        optimizer = build_sgd(model, lr=p.lr, momentum=p.momentum, weight_decay=p.weight_decay)
    else:  # GPSA groups: no decay on alpha / lambda / centres, gates at their own lr (as build_adamw)
        groups = param_groups(model, lr=p.lr, weight_decay=p.weight_decay, gate_lr=gate_lr(params))
        optimizer = torch.optim.SGD(groups, lr=p.lr, momentum=p.momentum, weight_decay=0.0)
    scheduler = WarmupCosine(optimizer, total_steps=p.epochs * spe, warmup_steps=round(p.warmup_epochs * spe))
    return optimizer, scheduler


def _metrics(
    params: Params,
    ds: Datasets,
    model: torch.nn.Module,
    result: FitResult,
    test: dict[str, float],
    keep: list[int],
    device: torch.device,
    t_wall: float,
) -> dict[str, Any]:
    """metrics.json of a trained CNN: the last epoch's train/val and the test loss and accuracy, the run's
    size, the epochs kept (``keep``), where and how fast it ran (``wall_s`` since ``t_wall``)."""
    last = result.history[-1]
    return {
        "train_loss": last["train_loss"],
        "train_acc": last["train_acc"],
        "val_loss": last.get("val_loss"),
        "val_acc": last.get("val_acc"),
        "test_loss": test["loss"],
        "test_acc": test["acc"],
        "epochs": params.pretrain.epochs,
        "steps": result.global_step,
        "train_images": int(len(ds.train_y)),
        "checkpoint_epochs": keep,
        "params_count": sum(t.numel() for t in model.parameters()),
        "device": device.type,
        "workers": D.world().size,
        "resumed": result.resumed_from is not None,
        "images_per_s": T.mean_rate(result.history),
        "train_time_s": sum(r["train_time_s"] for r in result.history),
        "wall_s": time.perf_counter() - t_wall,
    }


def _publish(
    work_dir: Path,
    out_dir: Path,
    model: torch.nn.Module,
    extra: dict[str, Any],
    result: FitResult,
    metrics: dict,
) -> None:
    """Publish the run into ``runs/pretrain/``: the kept epoch checkpoints (stale ones removed),
    ``cnn-final.pt``, history and metrics."""
    final = {"model": T.cpu_state(model), **extra, "kind": "model"}
    T.publish(
        work_dir,
        out_dir,
        checkpoints={f"ckpt/ckpt-epoch-{k:03d}.pt": v for k, v in result.epoch_checkpoints.items()},
        stale_glob="ckpt/ckpt-epoch-*.pt",
        objects={"cnn-final.pt": final},
        history=result.history,
        metrics=metrics,
    )


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
                                        backbone_options(params.model.record, params.model.options))  # fmt: skip
    except ValueError as err:
        raise StageError(str(err)) from None
    t_import = time.perf_counter() - t_wall
    for note in imported.notes:
        print(f"{NAME}: {note}", file=sys.stderr)
    model, device = imported.model, T.training_device()
    channels_last = T.use_channels_last(device)
    model.to(device)
    loaders = T.loaders(params, ds, batch_size=T.EVAL_BATCH, seed=params.cnn_seed, augment=None,
                        size=params.data.image_size)  # fmt: skip
    with deterministic(device):
        val = T.evaluate_split(model, loaders.val, device, channels_last, params) if loaders.val else {}
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)
    origin = {"weights": source.weights, "sha256": imported.sha256, "arch": params.model.arch,
              "classifier": imported.classifier, "source_classes": imported.source_classes,
              "head_replaced": imported.head_replaced}  # fmt: skip
    extra = {**T.extra_state(spec, ds, params.data.image_size), "source": origin,
             "network_code": _network_code(params)}  # fmt: skip
    state = {"kind": "model", "model": T.cpu_state(model), **extra, "epoch": params.t1(), "global_step": 0}
    metrics = {
        "imported": True,
        "source": origin,
        "normalization": T.input_normalization(params),
        "notes": imported.notes,
        "val_loss": val.get("loss"),
        "val_acc": val.get("acc"),
        "val_split_seed": params.cnn_seed,
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


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the prepared dataset exists, the checkpoint cadence is readable; an import's
    weights file has the sha256 params give (read again where it is loaded)."""
    T.require_dataset(params, root)
    T.checkpoint_every_steps(params, NAME)
    source = params.pretrain.source
    if source is not None and source.is_file:
        try:
            importing.read_weights(source.weights, source.sha256 or "")
        except ValueError as err:
            raise StageError(str(err)) from None
    if source is None:
        check_network(params, root)


def check_network(params: Params, root: Path = Path(".")) -> None:
    """The network this config pretrains takes the prepared dataset's images: built from its spec and run on
    one image of the dataset's channels and size before any run opens (model.options reach the builder, e.g.
    timm, as given: a dropout of 2, a channel count other than the data's, a fixed-size model on other sizes)."""
    from core.data import read_manifest

    manifest = read_manifest(root / params.data.dir)
    num_classes, in_chans = int(manifest["num_classes"]), int(manifest["image_shape"][-1])
    m, size = params.model, params.data.image_size
    given = m.options.get("in_chans")
    if given is not None and given != in_chans:
        raise StageError(
            f"model.options.in_chans: {given}, but the dataset's images have {in_chans} channel(s)"
        )
    try:
        with torch.no_grad():
            build_from_spec(model_spec(params, num_classes, in_chans)).eval()(
                torch.zeros(1, in_chans, size, size)
            )
    except Exception as err:  # whatever the builder or its forward raises: one line naming the config
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise StageError(
            f"model: {m.kind}/{m.arch} with options {m.options} does not take this dataset's {in_chans}-channel "
            f"{size} px images ({type(err).__name__}: {first})"
        ) from None


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, data_parallel=T.data_parallel, check=check)


if __name__ == "__main__":
    sys.exit(main())
