"""Fine-tuning, shared by the finetune stage (the T-CNN) and the control stage (the same pretrained CNN, no
attention): one training function, one identity, one seed stream, so the two arms differ only in the network
([TCNN21] Table 1, "without SA"). The recipe and what the outputs hold: the finetune stage's docstring.

It imports no attention code: the T-CNN's per-layer statistics come in through its `Variant`, so the control
(and its DVC deps) do not change when the attention layers do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.config import Params
from core.data import first_batch
from core.models.factory import set_stochastic_depth
from core.training import early_stop, recipes
from core.training.checkpoint import restore_rng
from core.training.environment import deterministic, seed_everything
from core.training.history import summarize_gpsa
from core.training.loop import fit
from core.training.model_eval import TrainLoss
from core.training.optim import freeze_parameters
from core.utils.hashing import derive_seed, file_digest, stable_hash
from stages.harness import chain
from stages.harness import training as T
from stages.harness.identity import stage_identity
from stages.harness.runner import StageError

NAME = "finetune"  # the params section and the seed stream of both variants (the T-CNN and its control)
PROBE = 128  # validation images fed through the network for the per-epoch nonlocality


@dataclass(frozen=True)
class Variant:
    """Which network a fine-tuning run trains, and where its files go (the T-CNN, or the matched control)."""

    name: str  # work dir runs/.partial/<name>, outputs runs/<name>/, progress label
    final: str  # the final model checkpoint, relative to runs/<name>/
    #: Per attention layer statistics each epoch and their long table (`core.analysis.dissect.layer_stats`,
    #: `long_rows`), given by the finetune stage; None for the control, which has no attention layer.
    layer_stats: Callable[[torch.nn.Module, Any], dict[str, Any]] | None = None
    long_rows: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None

    def out_dir(self, root: Path) -> Path:
        return root / chain.run_dir(self.name)

    def work_dir(self, root: Path) -> Path:
        return root / chain.partial_dir(self.name)


def identity(
    params: Params,
    inputs: Mapping[str, Any],
    device: str,
    *,
    freeze: Sequence[str] = (),
    variant: str = NAME,
    workers: int | None = None,
) -> dict[str, Any]:
    """What a fine-tuning run's result depends on (`stages.harness.identity`), for the T-CNN (``variant`` finetune) and
    its matched control (control): the seed, the data's meaning, the recipe (`finetune.mode`: fresh takes the
    finetune section and its augmentation, continue the pretraining's), the frozen names, and ``inputs``: the
    network it starts from (the DVC path: the checkpoint's sha256; a sweep's control: its pretraining's key
    and t1)."""
    parts: dict[str, Any] = {
        "seed": params.seed,
        "data": T.data_identity(params),
        "mode": params.finetune.mode,
        "freeze": sorted(freeze),
    }
    if params.cnn_seed != params.seed:  # the CNN's own seed sets the split (absent: identities as before)
        parts["cnn_seed"] = params.pretrain.seed
    if params.finetune.mode == "fresh":
        # stop: below; control_lr: the control's params carry it as lr (Params.for_control)
        skip = ("stop", "control_lr")
        parts["finetune"] = {k: v for k, v in T.section_identity(params.finetune).items() if k not in skip}
        parts["augment"] = params.augment_for("finetune").model_dump(mode="json")
    else:
        parts["pretrain"] = {k: v for k, v in T.section_identity(params.pretrain).items() if k != "seed"}
        parts["augment"] = params.augment_for("pretrain").model_dump(mode="json")
        parts["drop_path"] = params.model.drop_path
    if (
        params.finetune.stop is not None
    ):  # absent: the identities of runs made before the option stay the same
        parts["stop"] = params.finetune.stop.model_dump(mode="json")
    execution = T.execution_identity(params, workers)
    return stage_identity(variant, parts, inputs=inputs, device=device, execution=execution)


CONTROL = Variant("control", "model/control-final.pt")


def control_checkpoint(root: Path) -> Path:
    """The control's final model (what evaluate compares the T-CNN with)."""
    return CONTROL.out_dir(root) / CONTROL.final


def control_disabled_reason(params: Params) -> str | None:
    """Why this config has no matched control (None: it has one)."""
    if not params.finetune.control:
        return "finetune.control is false"
    if not params.model.record.has_control:
        return (
            f"model.kind={params.model.kind!r} fine-tunes without reparameterization: its fine-tuned model is "
            "already the control"
        )
    return None


def preflight(params: Params, root: Path, start: Path, what: str) -> None:
    """A fine-tuning run's check before any run opens (the T-CNN's and the control's): the checkpoint it
    starts from (``start``, the ``what``) and the prepared data exist, the checkpoint cadence is readable."""
    T.require_checkpoint(start, what)
    T.require_dataset(params, root)
    T.checkpoint_every_steps(params, NAME)


@dataclass(frozen=True)
class _Recipe:
    """What `finetune.mode` takes from where: "fresh" the finetune section ([TCNN21] Sec. 3), "continue" the
    pretraining run's own settings at t1 ([TCNN21] Table 3)."""

    size: int
    batch: int
    drop_path: float
    augment: Any
    order_seed: int
    batch_key: str
    carry: dict[str, Any] | None


def _recipe(params: Params, ckpt: dict[str, Any], src: Path, seed: int) -> _Recipe:
    f, p = params.finetune, params.pretrain
    if params.finetune.mode == "fresh":
        size = f.image_size or params.data.image_size
        return _Recipe(size, f.batch_size, f.drop_path, params.augment_for("finetune"), seed,
                       "finetune.batch_size", None)  # fmt: skip
    carry = ckpt["carry"]
    if int(carry["epoch"]) != params.reparam.epoch:
        raise StageError(
            f"{src}: was converted at epoch {int(carry['epoch'])} but reparam.epoch={params.reparam.epoch}; "
            "rerun the reparam stage"
        )
    size = int(ckpt.get("image_size") or params.data.image_size)
    return _Recipe(size, p.batch_size, params.model.drop_path, params.augment_for("pretrain"), params.seed,
                   "pretrain.batch_size", carry)  # fmt: skip


def _frozen(model: torch.nn.Module, names: list[str], strict: bool) -> list[str]:
    frozen = freeze_parameters(model, names) if names else []
    if names and not frozen and strict:
        raise StageError(f"finetune.freeze: no parameter of the model is named {names}")
    return frozen


def train(
    params: Params,
    root: Path,
    ckpt: dict[str, Any],
    src: Path,
    variant: Variant,
    *,
    freeze: Sequence[str] = (),
    strict_freeze: bool = True,
) -> dict[str, Any]:
    """Fine-tune the model of `ckpt` (read from `src`: {"model", "model_spec"[, "carry"]}) with the recipe of
    `finetune.mode` and publish it under runs/<variant.name>/. `strict_freeze`: a freeze name that matches
    no parameter is an error (the control passes False: the T-CNN's attention-only names do not exist there)."""
    t_wall = time.perf_counter()
    seed = derive_seed(params.seed, NAME)  # one stream for every variant (the control matches the T-CNN)
    seed_everything(seed)
    model = T.rebuild(ckpt, src)
    ds = T.datasets(params, root)
    device = T.training_device()
    freeze = sorted({*freeze, *params.finetune.freeze})
    frozen = _frozen(model, freeze, strict_freeze)
    r = _recipe(params, ckpt, src, seed)
    set_stochastic_depth(model, r.drop_path)
    loaders = T.loaders(ds, batch_size=r.batch, seed=r.order_seed, augment=r.augment, size=r.size,
                        num_workers=params.data.num_workers)  # fmt: skip
    spe = _steps(loaders, r.batch, ds, r.batch_key)
    try:
        recipe = (recipes.fresh(model, params.finetune, spe) if r.carry is None
                  else recipes.continued(model, params.pretrain, r.carry, spe))  # fmt: skip
    except ValueError as err:
        raise StageError(f"{src}: {err}") from None
    channels_last = T.use_channels_last(device)
    extra = T.extra_state(ckpt["model_spec"], ds, r.size)
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if params.finetune.stop is not None and loaders.val is None:
        raise StageError("finetune.stop: early stopping needs a validation split (data.val_size > 0)")
    run_hash = stable_hash(
        identity(params, {"checkpoint": file_digest(src)}, device.type, freeze=freeze, variant=variant.name)
    )
    work_dir = variant.work_dir(root)
    result, test = _fit(params, model, recipe, loaders, r, variant, seed, run_hash, extra, device, work_dir)
    metrics = _metrics(params, result, test, recipe, model, r.size, len(frozen), device, t_wall)
    metrics["data_roles"] = ds.roles  # which images trained, validated and tested (core.data.split_roles)
    final = {"kind": "model", "model": T.cpu_state(model), **extra, "source": {"checkpoint": str(src)}}
    csvs = {"gpsa.csv": variant.long_rows(result.history)} if variant.long_rows is not None else None
    T.publish(work_dir, variant.out_dir(root), objects={variant.final: final},
              history=result.history, csvs=csvs, metrics=metrics)  # fmt: skip
    return metrics


def _fit(
    params: Params, model: torch.nn.Module, recipe: Any, loaders: T.Loaders, r: _Recipe, variant: Variant,
    seed: int, run_hash: str, extra: dict[str, Any], device: torch.device, work_dir: Path,
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The training loop from the state right after reparameterization (history's first row), then the test
    split; the random streams restarted as the module docstring says (the control matches the T-CNN)."""
    epochs, scheduler, channels_last = recipe.epochs, recipe.scheduler, T.use_channels_last(device)
    probe = first_batch(loaders.val if loaders.val is not None else loaders.test, PROBE)

    def stats(m: torch.nn.Module, label: int) -> dict[str, Any]:
        s = variant.layer_stats(m, probe) if variant.layer_stats is not None else None  # on its real input
        return {"finetune_epoch": label - epochs.start, **({"gpsa": s} if s else {})}

    with deterministic(device):
        start = {"epoch": epochs.start, "step": scheduler.last_step}
        if loaders.val is not None:
            v = T.evaluate_split(model, loaders.val, device, channels_last, params)
            start.update(val_loss=v["loss"], val_acc=v["acc"])
        start.update(stats(model, epochs.start))
        if r.carry is None:
            seed_everything(seed)  # building the model drew from the stream: restart it (see the docstring)
        else:
            restore_rng(r.carry["rng"])  # the pretraining run's RNG states at t1
        result = fit(
            model,
            recipe.optimizer,
            scheduler,
            loaders.train,
            epochs=epochs,
            work_dir=work_dir,
            run_hash=run_hash,
            loss_fn=TrainLoss(r.augment.label_smoothing),
            val_loader=loaders.val,
            device=device,
            channels_last=channels_last,
            precision=params.precision,
            checkpoint_every_steps=T.checkpoint_every_steps(params, NAME),
            extra_state=extra,
            epoch_stats=stats,
            history_start=[start],
            early_stop=params.finetune.stop,
            desc=f"{variant.name}[{params.finetune.mode}]",
        )
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)
    return result, test


def _metrics(
    params: Params, result: Any, test: dict[str, Any], recipe: Any, model: torch.nn.Module, size: int,
    frozen: int, device: torch.device, t_wall: float,
) -> dict[str, Any]:  # fmt: skip
    """metrics.json: the published epoch (the best-validation one under early stopping) and the run."""
    last, trained = result.history[-1], result.history[1:]
    stopping: dict[str, Any] = {}
    if result.early_stop is not None:  # the published model is the best-validation epoch's
        last = next(r for r in result.history[1:] if r["epoch"] == result.early_stop["best_epoch"])
        stopping = _stop_metrics(result.early_stop, trained, last, params.finetune.stop, params.finetune.mode)
    return {
        "mode": params.finetune.mode,
        "epochs_run": len(trained) if stopping else len(recipe.epochs),
        **recipe.info,
        **T.fit_metrics(result, test, model, device, t_wall, last=last, trained=trained),
        "val_acc_start": result.history[0].get("val_acc"),
        "image_size": size,
        "frozen_parameters": frozen,
        **summarize_gpsa(last.get("gpsa") or {}),
        **stopping,
    }


def _stop_metrics(
    state: dict[str, Any], trained: list[dict[str, Any]], best: dict[str, Any], stop: Any, mode: str
) -> dict[str, Any]:
    """What the early-stopping rule did, in fine-tuning epochs (1 = the first epoch fine-tuned)."""
    kw = {"patience": stop.patience, "min_delta_images": stop.min_delta_images}
    return {
        "stopped_epoch": trained[-1]["finetune_epoch"],
        "best_epoch": best["finetune_epoch"],
        "best_val_accuracy": best["val_acc"],
        "stop_reason": early_stop.reason(
            state, **kw, max_key="finetune.epochs" if mode == "fresh" else "pretrain.epochs"
        ),
    }


def _steps(loaders: T.Loaders, batch: int, ds: Any, key: str) -> int:
    spe = len(loaders.train)
    if spe == 0:
        raise StageError(f"{key}: {batch} exceeds the {len(ds.train_y)} training images (no full batch)")
    return spe
