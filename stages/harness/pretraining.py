"""The CNN's pretraining run, the pieces the pretrain stage composes ([TCNN21] Sec. 2: the CNN trained for
`pretrain.epochs`, converted into a T-CNN at epoch t1): the epochs it keeps, the network it builds and checks,
its identity, its loaders, SGD + momentum with warmup then per-step cosine, its metrics and how it publishes.

The imported CNN (`pretrain.source`) is `stages.imported_cnn`; the stage itself (`stages.pretrain`) reads
params, runs `core.training.loop.fit` and writes its outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from core.config import Params
from core.data import Datasets
from core.models.builders import builder_module, is_builder, load_builder
from core.models.factory import set_stochastic_depth
from core.models.spec import build_from_spec, pretraining_spec
from core.training.loop import FitResult
from core.training.optim import WarmupCosine, build_sgd, param_groups
from core.utils.errors import first_line
from stages.harness import training as T
from stages.harness.identity import network_code as code_outside_deps
from stages.harness.identity import stage_identity
from stages.harness.runner import StageError

NAME = "pretrain"


def checkpoint_epochs(params: Params) -> list[int]:
    """Every t1 a run of this config may need: reparam.epoch, pretrain.checkpoint_epochs, the values of
    sweep.grid["reparam.epoch"], and the final epoch (in range 0..pretrain.epochs; 0 = the init); an
    imported CNN: its one state, t1 = 0 (`Params.t1`)."""
    if params.imports_cnn:
        return [params.t1()]
    wanted = {params.reparam.epoch, params.pretrain.epochs, *params.pretrain.checkpoint_epochs}
    wanted.update(int(v) for v in sweep_t1s(params))
    return sorted(e for e in wanted if 0 <= e <= params.pretrain.epochs)


def sweep_t1s(params: Params) -> list[Any]:
    """The values of ``sweep.grid["reparam.epoch"]`` in the params file (its sweep section is carried as
    written and typed only by the sweep, pipelines/sweep/settings.py; a sweep's trials get an empty grid)."""
    grid = params.model_dump(include={"sweep"}).get("sweep", {}).get("grid") or {}
    values = grid.get("reparam.epoch", []) if isinstance(grid, dict) else []
    return values if isinstance(values, list) else []


def model_spec(params: Params, num_classes: int, in_chans: int) -> dict[str, Any]:
    """The spec of the network this config pretrains (`core.models.spec.pretraining_spec`)."""
    m = params.model
    return pretraining_spec(m.record, m.arch, m.options, num_classes, in_chans, params.data.image_size)


def gate_lr(params: Params) -> float | None:
    """A kind that pretrains gated attention (hybrid_scratch) trains its gates at finetune.gate_lr (the
    fine-tuning recipe's gate lr, [TCNN21] Sec. 3); other kinds: one lr for every parameter."""
    return params.finetune.gate_lr if params.model.record.pretrains_attention else None


def training_identity(
    params: Params, spec: dict[str, Any], data_fingerprint: str, device: str, workers: int | None = None
) -> dict[str, Any]:
    """What a pretraining run's result depends on (`stages.harness.identity`): the seed, the data's meaning and
    content, the network it trains (``spec``, `model_spec`: kinds cnn, tcnn and psa pretrain the same CNN) with
    its drop_path, the pretrain section and its effective augmentation, and the gate lr the stage derives.
    Which epochs are kept is not part of it (a sweep's group keeps every t1 its trials need); the resume hash
    (`stages.pretrain.run_hash`) adds it."""
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


def network_code(params: Params) -> dict[str, str]:
    """The pretraining network's code that dvc.yaml does not list (`stages.harness.identity.network_code`): the
    kind's, and a user's builder's when model.arch names one (its files, or its distribution's version)."""
    arch, builder = params.model.arch, None
    if is_builder(arch):
        load_builder(arch)  # imported from the workspace, as the network is built
        builder = builder_module(arch)
    return code_outside_deps(NAME, params.model.record.pretraining_record().code(), builder=builder)


def build_model(params: Params, spec: dict[str, Any]) -> torch.nn.Module:
    """The network of ``spec`` (a bad model section: one-line StageError), with ``model.drop_path``'s
    stochastic depth."""
    try:
        model = build_from_spec(spec)
    except (ValueError, TypeError) as err:
        raise StageError(f"model: cannot build {params.model.arch!r} ({err})") from None
    set_stochastic_depth(model, params.model.drop_path)
    return model


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
        first = first_line(err, 200)
        raise StageError(
            f"model: {m.kind}/{m.arch} with options {m.options} does not take this dataset's {in_chans}-channel "
            f"{size} px images ({type(err).__name__}: {first})"
        ) from None


def loaders(params: Params, ds: Datasets, augment: Any) -> tuple[T.Loaders, int]:
    """The train, validation and test loaders at ``pretrain.batch_size``, and the optimizer steps per epoch
    (a batch size above the training set: StageError)."""
    p = params.pretrain
    loaders = T.loaders(
        ds,
        batch_size=p.batch_size,
        seed=params.cnn_seed,
        augment=augment,
        size=params.data.image_size,
        num_workers=params.data.num_workers,
    )
    spe = len(loaders.train)
    if spe == 0:
        raise StageError(
            f"pretrain.batch_size: {p.batch_size} exceeds the {len(ds.train_y)} training images (no full batch)"
        )
    return loaders, spe


def optimization(params: Params, model: torch.nn.Module, spe: int) -> tuple[torch.optim.SGD, WarmupCosine]:
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


def metrics(
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
    return {
        **T.fit_metrics(result, test, model, device, t_wall, last=result.history[-1], trained=result.history),
        "epochs": params.pretrain.epochs,
        "train_images": int(len(ds.train_y)),
        "data_roles": ds.roles,
        "checkpoint_epochs": keep,
    }


def publish(
    work_dir: Path,
    out_dir: Path,
    model: torch.nn.Module,
    extra: dict[str, Any],
    result: FitResult,
    metrics: dict[str, Any],
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
