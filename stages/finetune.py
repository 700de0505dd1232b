"""Stage `finetune`: train the reparameterized network from `root/runs/reparam/tcnn.pt`.

`finetune.mode` picks the recipe (`core.training.recipes`):
- "fresh" ([TCNN21] Sec. 3): AdamW, linear warmup over `finetune.warmup_epochs` to
  lr = finetune.lr x finetune.batch_size / 1024, then per-step cosine decay over `finetune.epochs`; the
  gating parameters lambda (Eq. 7) use finetune.gate_lr x finetune.batch_size / 1024 (the paper gives both
  at batch 1024; scaling both keeps its gate / weight ratio), on the same warmup + cosine shape; no weight
  decay on alpha, lambda, attention centres, norms and biases; stochastic depth `finetune.drop_path` (timm's
  linear rule over the ResNet blocks); augmentation `Params.augment_for("finetune")`; resolution
  `finetune.image_size` (null = pretraining resolution); data order seeded by derive_seed(seed, "finetune").
- "continue" ([TCNN21] Table 3): the pretraining run goes on with the T-CNN in place of the CNN. It trains the
  t2 = pretrain.epochs - reparam.epoch epochs that remain of the schedule planned over pretrain.epochs
  (`finetune.epochs` is ignored in this mode; t2 = 0 just evaluates the converted network), with the CNN
  run's SGD (pretrain.lr, momentum, weight_decay), its per-step warmup + cosine schedule at the step it
  reached, its momentum buffers (a converted conv's buffer moves to the GPSA parameter that holds the
  filter; new GPSA parameters start with empty state), its RNG states, its data order (epochs t1..E-1 of
  the same BatchLoader seed), batch size, augmentation, resolution and `model.drop_path`. Gates get the
  same lr as every other parameter: one optimizer, one schedule.

The matched control (stages/control.py) runs this same function on the CNN checkpoint at t1 (no
reparameterization): the same optimizer, lr schedule, epochs, resolution, augmentation, stochastic depth, data
order and seeds -- only the network differs ([TCNN21] Table 1, "without SA"). To keep the random streams equal, the
global RNG is re-seeded after the model is built (building a T-CNN draws its new W_qry/W_key), so stochastic
depth draws the same masks in both runs.

Outputs (`root/runs/finetune/`, published when the run completes): tcnn-final.pt (model checkpoint),
history.csv / history.json (one row per epoch, the first row being the state right after
reparameterization; per attention layer (GPSA, PSA, ConViT, AA, cmhsa's MHSA; `core.analysis.dissect.layer_stats`)
mean 1/alpha, sigma(lambda) where the layer has them, and the nonlocality ([ConViT21] Eq. 8) on the layer's real
input for a fixed validation batch), gpsa.csv (per epoch, layer and head), metrics.json. Every model kind
fine-tunes the same way: AdamW groups from `core.training.optim.param_groups` (GPSA / PSA positional parameters
without weight decay, GPSA gates at finetune.gate_lr); parameters frozen by ablation switches stay frozen.
Resume as in the pretrain stage (`root/runs/.partial/finetune/`).

`finetune.stop` (optional; `core.training.early_stop`): the run stops once validation accuracy plateaus and
publishes the best-validation epoch's weights; metrics.json then says `stopped_epoch`, `best_epoch`,
`best_val_accuracy` (fine-tuning epochs, 1-based) and `stop_reason`, for the T-CNN and the control alike.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from core.analysis.dissect import layer_stats, long_rows
from core.config import Params
from core.data import first_batch
from core.models import set_stochastic_depth
from core.models.spec import build_from_spec
from core.training import distributed as D
from core.training import early_stop, recipes
from core.training.checkpoint import restore_rng
from core.training.history import summarize_gpsa
from core.training.loop import (
    TrainLoss,
    deterministic,
    fit,
    seed_everything,
)
from core.training.optim import freeze_parameters
from core.utils.hashing import derive_seed, file_digest, stable_hash
from stages import chain
from stages import training as T
from stages.identity import stage_identity
from stages.runner import StageError, stage_main

NAME = "finetune"
PROBE = 128  # validation images fed through the network for the per-epoch nonlocality


@dataclass(frozen=True)
class Variant:
    """Which network a fine-tuning run trains, and where its files go (the T-CNN, or the matched control)."""

    name: str  # work dir runs/.partial/<name>, outputs runs/<name>/, progress label
    final: str  # the final model checkpoint, relative to runs/<name>/

    def out_dir(self, root: Path) -> Path:
        return root / chain.run_dir(self.name)

    def work_dir(self, root: Path) -> Path:
        return root / chain.partial_dir(self.name)


TCNN = Variant(NAME, "tcnn-final.pt")


def source_path(root: Path) -> Path:
    return root / chain.output("reparam", "tcnn.pt")


def identity(
    params: Params,
    inputs: Mapping[str, Any],
    device: str,
    *,
    freeze: Sequence[str] = (),
    variant: str = NAME,
    workers: int | None = None,
) -> dict[str, Any]:
    """What a fine-tuning run's result depends on (`stages.identity`), for the T-CNN (``variant`` finetune) and
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


def run(params: Params, *, root: Path = Path("."), freeze: Sequence[str] = ()) -> dict[str, Any]:
    """Fine-tune the reparameterized network; `freeze` (plus `finetune.freeze`) names parameters to keep fixed."""
    root = Path(root)
    src = source_path(root)
    required = ("model", "model_spec") + (("carry",) if params.finetune.mode == "continue" else ())
    ckpt = T.load_checkpoint(src, required, "reparameterized model written by the reparam stage")
    return train(params, root, ckpt, src, TCNN, freeze=freeze)


def _build(ckpt: dict[str, Any], src: Path) -> torch.nn.Module:
    try:
        model = build_from_spec(ckpt["model_spec"])
        model.load_state_dict(ckpt["model"])
    except (ValueError, TypeError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"{src}: cannot rebuild the model from this checkpoint ({first})") from None
    return model


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
    out_dir, work_dir = variant.out_dir(root), variant.work_dir(root)
    mode = params.finetune.mode
    seed = derive_seed(params.seed, NAME)  # one stream for every variant (the control matches the T-CNN)
    seed_everything(seed)
    model = _build(ckpt, src)
    spec = ckpt["model_spec"]
    ds = T.datasets(params, root)
    device = T.training_device()
    f, p = params.finetune, params.pretrain
    freeze = sorted({*freeze, *f.freeze})
    frozen = freeze_parameters(model, freeze) if freeze else []
    if freeze and not frozen and strict_freeze:
        raise StageError(f"finetune.freeze: no parameter of the model is named {freeze}")

    if mode == "fresh":
        size, batch, drop_path = f.image_size or params.data.image_size, f.batch_size, f.drop_path
        augment, order_seed, key = params.augment_for("finetune"), seed, "finetune.batch_size"
    else:
        carry = ckpt["carry"]
        if int(carry["epoch"]) != params.reparam.epoch:
            raise StageError(
                f"{src}: was converted at epoch {int(carry['epoch'])} but reparam.epoch={params.reparam.epoch}; "
                "rerun the reparam stage"
            )
        size, batch, drop_path = (
            int(ckpt.get("image_size") or params.data.image_size),
            p.batch_size,
            params.model.drop_path,
        )
        augment, order_seed, key = params.augment_for("pretrain"), params.seed, "pretrain.batch_size"
    set_stochastic_depth(model, drop_path)
    loaders = T.loaders(params, ds, batch_size=batch, seed=order_seed, augment=augment, size=size)
    spe = _steps(loaders, batch, ds, key)
    try:
        recipe = recipes.fresh(model, f, spe) if mode == "fresh" else recipes.continued(model, p, carry, spe)
    except ValueError as err:
        raise StageError(f"{src}: {err}") from None
    optimizer, scheduler, epochs, info = recipe.optimizer, recipe.scheduler, recipe.epochs, recipe.info

    channels_last = T.use_channels_last(device)
    extra = T.extra_state(spec, ds, size)
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    if f.stop is not None and loaders.val is None:
        raise StageError("finetune.stop: early stopping needs a validation split (data.val_size > 0)")
    probe = first_batch(loaders.val if loaders.val is not None else loaders.test, PROBE)

    def stats(m: torch.nn.Module, label: int) -> dict[str, Any]:
        s = layer_stats(m, probe)  # every attention layer, on its real input (core.analysis.dissect)
        return {"finetune_epoch": label - epochs.start, **({"gpsa": s} if s else {})}

    with deterministic(device):
        start = {"epoch": epochs.start, "step": scheduler.last_step}
        if loaders.val is not None:
            v = T.evaluate_split(model, loaders.val, device, channels_last, params)
            start.update(val_loss=v["loss"], val_acc=v["acc"])
        start.update(stats(model, epochs.start))
        if mode == "fresh":
            seed_everything(seed)  # building the model drew from the stream: restart it (see the docstring)
        else:
            restore_rng(carry["rng"])  # the pretraining run's RNG states at t1
        result = fit(
            model,
            optimizer,
            scheduler,
            loaders.train,
            epochs=epochs,
            work_dir=work_dir,
            run_hash=stable_hash(
                identity(
                    params, {"checkpoint": file_digest(src)}, device.type, freeze=freeze, variant=variant.name
                )
            ),
            loss_fn=TrainLoss(augment.label_smoothing),
            val_loader=loaders.val,
            device=device,
            channels_last=channels_last,
            precision=params.precision,
            checkpoint_every_steps=T.checkpoint_every_steps(params, NAME),
            extra_state=extra,
            epoch_stats=stats,
            history_start=[start],
            early_stop=f.stop,
            desc=f"{variant.name}[{mode}]",
        )
        test = T.evaluate_split(model, loaders.test, device, channels_last, params)

    last = result.history[-1]
    trained = result.history[1:]
    stopping: dict[str, Any] = {}
    if result.early_stop is not None:  # the published model is the best-validation epoch's
        last = next(r for r in result.history[1:] if r["epoch"] == result.early_stop["best_epoch"])
        stopping = _stop_metrics(result.early_stop, trained, last, f.stop, mode)
    metrics: dict[str, Any] = {
        "mode": mode,
        "epochs_run": len(trained) if stopping else len(epochs),
        **info,
        "train_loss": last.get("train_loss"),
        "train_acc": last.get("train_acc"),
        "val_loss": last.get("val_loss"),
        "val_acc": last.get("val_acc"),
        "val_acc_start": result.history[0].get("val_acc"),
        "test_loss": test["loss"],
        "test_acc": test["acc"],
        "steps": result.global_step,
        "image_size": size,
        "params_count": sum(t.numel() for t in model.parameters()),
        "device": device.type,
        "workers": D.world().size,
        "resumed": result.resumed_from is not None,
        "frozen_parameters": len(frozen),
        **summarize_gpsa(last.get("gpsa") or {}),
        "images_per_s": T.mean_rate(trained),
        "train_time_s": sum(r["train_time_s"] for r in trained),
        "wall_s": time.perf_counter() - t_wall,
        **stopping,
    }
    final = {"kind": "model", "model": T.cpu_state(model), **extra, "source": {"checkpoint": str(src)}}
    T.publish(
        work_dir,
        out_dir,
        objects={variant.final: final},
        history=result.history,
        csvs={"gpsa.csv": long_rows(result.history)} if variant is TCNN else None,
        metrics=metrics,
    )
    return metrics


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


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the reparameterized model exists, the data too, the checkpoint cadence is readable."""
    T.require_checkpoint(source_path(root), "reparameterized model written by the reparam stage")
    T.require_dataset(params, root)
    T.checkpoint_every_steps(params, NAME)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, data_parallel=T.data_parallel, check=check)


if __name__ == "__main__":
    sys.exit(main())
