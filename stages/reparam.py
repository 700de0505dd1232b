"""Stage `reparam`: turn the CNN checkpointed at epoch t1 = `reparam.epoch` into a T-CNN (000 Sec. 2).

Reads `root/runs/pretrain/ckpt/ckpt-epoch-{t1:03d}.pt`, applies `core.reparam.to_tcnn` with `reparam.alpha_init`,
`reparam.lambda_init`, `reparam.stages` and `reparam.stride_mode`, and writes to `root/runs/reparam/`:

  tcnn.pt            model checkpoint (model + model_spec with its "tcnn" section + normalization) plus
                     "carry": the CNN run's optimizer state moved onto the T-CNN's parameter names (a
                     converted conv's momentum goes to the GPSA parameter holding that filter), its
                     scheduler state, global step and RNG states -- what fine-tuning in "continue" mode
                     resumes from (000 Table 3).
  equivalence.json   max / mean |logit diff| T-CNN vs CNN on a validation batch (eval mode), the same for
                     the other stride mode, and the accuracy of both networks on the validation and test sets.

For model kinds other than "tcnn" (e.g. "cnn": Table 1's fine-tuning "without SA" baseline) the network
passes through unconverted, with the same files.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from core.checkpoint import atomic_save, atomic_write_json, build_from_spec, make_model_spec
from core.config import Params
from core.optim import map_state_to_tcnn, named_state
from core.train import (
    derive_seed,
    evaluate,
    file_fingerprint,
    first_batch,
    predict,
    seed_everything,
    select_device,
)
from stages import _training as T
from stages._cli import StageError, stage_main

NAME = "reparam"
PROBE = 256  # images in the equivalence batch
REQUIRED = ("model", "model_spec", "optimizer", "param_names", "scheduler", "rng", "epoch", "global_step")


def source_path(params: Params, root: Path) -> Path:
    return root / "runs" / "pretrain" / "ckpt" / f"ckpt-epoch-{params.reparam.epoch:03d}.pt"


def convert(cnn: torch.nn.Module, params: Params, stride_mode: str | None = None) -> torch.nn.Module:
    from core.reparam import to_tcnn

    r = params.reparam
    return to_tcnn(
        cnn,
        alpha_init=r.alpha_init,
        lambda_init=r.lambda_init,
        stages=tuple(r.stages),
        stride_mode=stride_mode or r.stride_mode,
    )


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    t_wall = time.perf_counter()
    root = Path(root)
    out_dir = root / "runs" / NAME
    src = source_path(params, root)
    ckpt = T.load_checkpoint(src, REQUIRED, f"pretraining checkpoint at reparam.epoch={params.reparam.epoch}")
    try:
        cnn = build_from_spec(ckpt["model_spec"])
        cnn.load_state_dict(ckpt["model"])
    except (ValueError, TypeError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"{src}: cannot rebuild the CNN from this checkpoint ({first})") from None
    if ckpt["model_spec"].get("tcnn") is not None:
        raise StageError(f"{src}: holds a T-CNN already; the reparam stage expects a CNN checkpoint")
    ds = T.datasets(params, root)
    device = select_device()
    cnn.eval()

    spec_cnn = ckpt["model_spec"]
    seed_everything(derive_seed(params.seed, NAME))  # the GPSA's new W_qry, W_key draw from this stream
    if params.model.kind == "tcnn":
        tcnn = convert(cnn, params)
        r = params.reparam
        tcnn_spec = {
            "alpha_init": r.alpha_init,
            "lambda_init": r.lambda_init,
            "stages": list(r.stages),
            "stride_mode": r.stride_mode,
        }
        spec = make_model_spec("tcnn", spec_cnn["arch"], spec_cnn["num_classes"], spec_cnn["in_chans"],
                               spec_cnn["options"], tcnn_spec)  # fmt: skip
        note = None
    else:
        tcnn = build_from_spec(spec_cnn)
        tcnn.load_state_dict(cnn.state_dict())
        spec = spec_cnn
        note = f"model.kind={params.model.kind!r}: no reparameterization, the network passes through"
    tcnn.eval()

    # Optimizer state for "continue" fine-tuning, keyed by the T-CNN's parameter names.
    try:
        state, moved = map_state_to_tcnn(named_state(ckpt["optimizer"], ckpt["param_names"]), tcnn)
    except KeyError as err:
        raise StageError(f"{src}: optimizer state does not map onto the T-CNN ({err})") from None

    # Equivalence report (eval mode: BN uses running statistics, so both compute deterministic functions).
    size = ckpt.get("image_size") or ds.image_size
    loaders = T.loaders(params, ds, batch_size=T.EVAL_BATCH, seed=params.seed, augment=None, size=size)
    probe_loader = loaders.val if loaders.val is not None else loaders.test
    probe = first_batch(probe_loader, PROBE)
    cnn.to(device)
    tcnn.to(device)
    logits_cnn, logits_tcnn = predict(cnn, probe), predict(tcnn, probe)
    diff = (logits_tcnn - logits_cnn).abs()
    report: dict[str, Any] = {
        "reparam_epoch": params.reparam.epoch,
        "alpha_init": params.reparam.alpha_init,
        "lambda_init": params.reparam.lambda_init,
        "stride_mode": params.reparam.stride_mode,
        "stages": list(params.reparam.stages),
        "converted": spec.get("tcnn") is not None,
        "probe_images": int(probe.shape[0]),
        "max_abs_logit_diff": float(diff.max()) if diff.numel() else None,
        "mean_abs_logit_diff": float(diff.mean()) if diff.numel() else None,
        "max_abs_logit_cnn": float(logits_cnn.abs().max()) if diff.numel() else None,
        "prediction_agreement": float((logits_cnn.argmax(-1) == logits_tcnn.argmax(-1)).float().mean()),
        "gpsa_layers": [name for name, _ in _gpsa(tcnn)],
        "params_cnn": sum(p.numel() for p in cnn.parameters()),
        "params_tcnn": sum(p.numel() for p in tcnn.parameters()),
        "optimizer_state_renamed": {k: v for k, v in moved.items() if k != v},
    }
    if spec.get("tcnn") is not None:
        other = "s1" if params.reparam.stride_mode == "exact" else "exact"
        try:
            alt = convert(cnn, params, other).to(device)
            d_alt = (predict(alt, probe) - logits_cnn).abs()
            report[f"max_abs_logit_diff_{other}"] = float(d_alt.max())
        except (ValueError, NotImplementedError) as err:
            report[f"max_abs_logit_diff_{other}"] = None
            report[f"{other}_error"] = str(err)
    cl = T.use_channels_last(device)  # the accuracies: fast layout (the logit diffs above use NCHW)
    if cl:
        cnn.to(memory_format=torch.channels_last)
        tcnn.to(memory_format=torch.channels_last)
    for split, loader in (("val", loaders.val), ("test", loaders.test)):
        if loader is None:
            continue
        a = evaluate(cnn, loader.batches(0), device=device, channels_last=cl)
        b = evaluate(tcnn, loader.batches(0), device=device, channels_last=cl)
        report[f"{split}_acc_cnn"], report[f"{split}_acc_tcnn"] = a["acc"], b["acc"]
        report[f"{split}_loss_cnn"], report[f"{split}_loss_tcnn"] = a["loss"], b["loss"]
    if note:
        report["note"] = note
    report["wall_s"] = time.perf_counter() - t_wall

    out = {
        "kind": "model",
        "model": T.cpu_state(tcnn),
        "model_spec": spec,
        "normalization": ckpt.get("normalization", {"mean": ds.mean, "std": ds.std}),
        "image_size": int(size),
        "source": {
            "checkpoint": str(src.relative_to(root)) if src.is_relative_to(root) else str(src),
            "sha256": file_fingerprint(src),
            "epoch": int(ckpt["epoch"]),
        },
        "carry": {
            "optimizer_state": state,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in ckpt["optimizer"]["param_groups"]
            ],
            "scheduler": ckpt["scheduler"],
            "epoch": int(ckpt["epoch"]),
            "global_step": int(ckpt["global_step"]),
            "steps_per_epoch": int(ckpt.get("steps_per_epoch", 0)),
            "rng": ckpt["rng"],
            "moved": moved,
        },
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(out, out_dir / "tcnn.pt")
    atomic_write_json(out_dir / "equivalence.json", report)
    return report


def _gpsa(model: torch.nn.Module) -> list:
    try:
        from core.reparam import gpsa_modules
    except ImportError:
        return []
    return list(gpsa_modules(model))


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv)


if __name__ == "__main__":
    sys.exit(main())
