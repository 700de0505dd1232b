"""Stage `reparam`: turn the CNN checkpointed at epoch t1 = `reparam.epoch` (or the imported CNN, t1 = 0,
`Params.t1`) into a T-CNN ([TCNN21] Sec. 2).

Reads `root/runs/pretrain/ckpt/ckpt-epoch-{t1:03d}.pt`, applies `core.reparam.to_tcnn` with `reparam.alpha_init`,
`reparam.lambda_init`, `reparam.stages` and `reparam.stride_mode`, and writes to `root/runs/reparam/`:

  tcnn.pt            model checkpoint (model + model_spec with its "tcnn" section + normalization) plus
                     "carry": the CNN run's optimizer state moved onto the T-CNN's parameter names (a
                     converted conv's momentum goes to the GPSA parameter holding that filter), its
                     scheduler state, global step and RNG states -- what fine-tuning in "continue" mode
                     resumes from ([TCNN21] Table 3).
  equivalence.json   max / mean |logit diff| T-CNN vs CNN on a validation batch (eval mode), the same for
                     the other stride mode, and the accuracy of both networks on the validation and test sets.

What happens to the network is the kind's registry record's business (`core.models.reparameterize`): a
converting kind ("tcnn": GPSA, [TCNN21] Sec. 2; "psa": [Cordonnier20]) converts with the reparam section's
settings and the ablation switches of `model.options`; a two-phase kind ("cmhsa", [Li21] Theorem 1) maps its
first phase onto its second, carrying the optimizer state of parameters that keep their name and shape; every
other kind passes through unconverted, with the same files.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from core.analysis.equivalence import LARGE_INIT, PAPER_INIT, agreement, features_before
from core.config import Params
from core.data import first_batch
from core.models.kinds import Conversion
from core.models.reparam import attention_modules, gpsa_modules, to_attention
from core.models.reparameterize import reparameterize
from core.models.spec import build_from_spec
from core.training.checkpoint import atomic_save
from core.training.loop import evaluate, predict, seed_everything, select_device
from core.training.optim import map_state_to_tcnn, named_state
from core.utils.atomic import atomic_write_json
from core.utils.hashing import derive_seed, file_digest
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main
from stages.pretrained import load_source, source_label, source_path

NAME = "reparam"
PROBE = 256  # images in the equivalence batch


def conversion(params: Params) -> Conversion:
    """The conversion params ask for (model.kind's record, the reparam section, model.options)."""
    return params.model.record.conversion_of(params.reparam, params.model.options)


def _carry_by_name(state: dict[str, dict[str, Any]], model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """The optimizer state of the parameters that exist in ``model`` under the same name and shape."""
    params = dict(model.named_parameters())
    out = {}
    for name, st in state.items():
        p = params.get(name)
        if p is not None and all(
            not (isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape != p.shape) for v in st.values()
        ):
            out[name] = st
    return out


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Convert the t1 checkpoint (module docstring), measure how far the result is from the CNN, and write
    ``tcnn.pt`` and ``equivalence.json``; returns the equivalence report."""
    t_wall = time.perf_counter()
    root = Path(root)
    src = source_path(params, root)
    ckpt = load_source(params, root)
    cnn = _load_cnn(ckpt, src)
    ds = T.datasets(params, root)
    device = select_device()
    seed_everything(derive_seed(params.seed, NAME))  # the new W_qry, W_key (and such) draw from this stream
    made, state, moved, note = _convert(params, cnn, ckpt, src)
    tcnn = made.model
    # Equivalence report (eval mode: BN uses running statistics, so both compute deterministic functions).
    size = ckpt.get("image_size") or ds.image_size
    loaders = T.loaders(params, ds, batch_size=T.EVAL_BATCH, seed=params.seed, augment=None, size=size)
    probe = first_batch(loaders.val if loaders.val is not None else loaders.test, PROBE)
    cnn.to(device)
    tcnn.to(device)
    compare = Comparison(ckpt.get("source"))
    logits_cnn = compare(cnn, probe)
    report = _equivalence(params, ckpt, cnn, made, probe, logits_cnn, compare)
    report["optimizer_state_renamed"] = {k: v for k, v in moved.items() if k != v}
    if made.converted and params.model.record.attention is not None:
        report.update(_other_modes(params, cnn, probe, logits_cnn, loaders, device, compare))
    report.update(_accuracies(cnn, tcnn, loaders, device))
    if note:
        report["note"] = note
    report["wall_s"] = time.perf_counter() - t_wall
    _write(root, src, ckpt, made.spec, tcnn, ds, int(size), state, moved)
    atomic_write_json(root / chain.run_dir(NAME) / "equivalence.json", report)
    return report


def _load_cnn(ckpt: dict[str, Any], src: Path) -> torch.nn.Module:
    try:
        cnn = build_from_spec(ckpt["model_spec"])
        cnn.load_state_dict(ckpt["model"])
    except (ValueError, TypeError, KeyError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise StageError(f"{src}: cannot rebuild the CNN from this checkpoint ({first})") from None
    return cnn.eval()


def _convert(
    params: Params, cnn: torch.nn.Module, ckpt: dict[str, Any], src: Path
) -> tuple[Any, dict[str, Any], dict[str, str], str | None]:
    """The kind's network made from the CNN (`core.models.reparameterize`) and the optimizer state for
    "continue" fine-tuning, keyed by its parameter names ([TCNN21] Table 3)."""
    kind, spec_cnn = params.model.record, ckpt["model_spec"]
    state_in = named_state(ckpt["optimizer"], ckpt["param_names"]) if "optimizer" in ckpt else {}
    try:
        made = reparameterize(cnn, spec_cnn, kind, params.reparam, params.model.options)
    except ValueError as err:
        raise StageError(
            f"reparam: cannot convert {spec_cnn['arch']!r} to kind {kind.name!r} ({err})"
        ) from None
    note = made.note
    if made.carry_by_name:
        dropped = sorted(set(state_in) - set(_carry_by_name(state_in, made.model)))
        state_in = _carry_by_name(state_in, made.model)
        note = f"{note}; no optimizer state for {dropped}"
    made.model.eval()
    try:
        state, moved = map_state_to_tcnn(state_in, made.model)
    except KeyError as err:
        raise StageError(f"{src}: optimizer state does not map onto the T-CNN ({err})") from None
    return made, state, moved, note


def _equivalence(
    params: Params, ckpt: dict[str, Any], cnn: torch.nn.Module, made: Any, probe: torch.Tensor,
    logits_cnn: torch.Tensor, compare: Comparison,
) -> dict[str, Any]:  # fmt: skip
    """How close the converted network computes the CNN's function on the probe batch ([TCNN21] Sec. 2)."""
    tcnn, r = made.model, params.reparam
    return {
        "reparam_epoch": params.t1(),
        "imported": params.imports_cnn,
        "source": ckpt.get("source"),
        "normalization": T.input_normalization(params),
        "compared": compare.what,
        "alpha_init": r.alpha_init,
        "lambda_init": r.lambda_init,
        "stride_mode": r.stride_mode,
        "stages": list(r.stages),
        "kind": params.model.kind,
        "converted": made.converted,
        "probe_images": int(probe.shape[0]),
        **agreement(logits_cnn, compare(tcnn, probe)),
        "gpsa_layers": [name for name, _ in gpsa_modules(tcnn)],
        "attention_layers": [name for name, _ in attention_modules(tcnn)],
        "params_cnn": sum(p.numel() for p in cnn.parameters()),
        "params_tcnn": sum(p.numel() for p in tcnn.parameters()),
    }


def _other_modes(
    params: Params, cnn: torch.nn.Module, probe: torch.Tensor, logits_cnn: torch.Tensor, loaders: Any,
    device: Any, compare: Comparison,
) -> dict[str, Any]:  # fmt: skip
    """The same distance with the other stride mode and at the paper's and a large init (`_other_inits`)."""
    other = "s1" if params.reparam.stride_mode == "exact" else "exact"
    out: dict[str, Any] = {}
    try:
        alt = to_attention(cnn, conversion(params).replace(stride_mode=other)).to(device)
        out[f"max_abs_logit_diff_{other}"] = agreement(logits_cnn, compare(alt, probe))["max_abs_logit_diff"]
    except (ValueError, NotImplementedError) as err:
        out[f"max_abs_logit_diff_{other}"] = None
        out[f"{other}_error"] = str(err)
    out["inits"] = _other_inits(cnn, params, probe, logits_cnn, loaders.test, device, compare)
    return out


def _accuracies(cnn: torch.nn.Module, tcnn: torch.nn.Module, loaders: Any, device: Any) -> dict[str, Any]:
    """Validation and test accuracy and loss of both networks right after the conversion."""
    cl = T.use_channels_last(device)  # the accuracies: fast layout (the logit diffs above use NCHW)
    if cl:
        cnn.to(memory_format=torch.channels_last)
        tcnn.to(memory_format=torch.channels_last)
    out: dict[str, Any] = {}
    for split, loader in (("val", loaders.val), ("test", loaders.test)):
        if loader is None:
            continue
        a = evaluate(cnn, loader.batches(0), device=device, channels_last=cl)
        b = evaluate(tcnn, loader.batches(0), device=device, channels_last=cl)
        out[f"{split}_acc_cnn"], out[f"{split}_acc_tcnn"] = a["acc"], b["acc"]
        out[f"{split}_loss_cnn"], out[f"{split}_loss_tcnn"] = a["loss"], b["loss"]
    return out


def _write(
    root: Path, src: Path, ckpt: dict[str, Any], spec: dict[str, Any], tcnn: torch.nn.Module, ds: Any,
    size: int, state: dict[str, Any], moved: dict[str, str],
) -> None:  # fmt: skip
    """``tcnn.pt``: the converted network, where it came from, and what "continue" fine-tuning carries."""
    out = {
        "kind": "model",
        "model": T.cpu_state(tcnn),
        "model_spec": spec,
        "normalization": ckpt.get("normalization", {"mean": ds.mean, "std": ds.std}),
        "image_size": size,
        "source": {
            "checkpoint": str(src.relative_to(root)) if src.is_relative_to(root) else str(src),
            "sha256": file_digest(src),
            "epoch": int(ckpt["epoch"]),
        },
        "carry": T.carry(ckpt, state, moved) if "optimizer" in ckpt else None,
    }
    out_dir = root / chain.run_dir(NAME)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(out, out_dir / "tcnn.pt")


def _other_inits(
    cnn: torch.nn.Module,
    params: Params,
    probe: torch.Tensor,
    logits_cnn: torch.Tensor,
    test: Any,
    device: Any,
    compare: Comparison,
) -> list[dict[str, Any]]:
    """How far the converted network is from the CNN at the paper's init and at a large init, next to the
    configured one: max |logit diff| and prediction agreement on the probe batch, and at the paper's init the
    test accuracy right after reparameterization (what the paper's fine-tuning starts from)."""
    configured = (params.reparam.alpha_init, params.reparam.lambda_init)
    rows = []
    for label, (a, lam) in (("paper", PAPER_INIT), ("large", LARGE_INIT)):
        if (a, lam) == configured:
            continue
        other = to_attention(cnn, conversion(params).replace(alpha_init=a, lambda_init=lam))
        other = other.to(device).eval()
        near = agreement(logits_cnn, compare(other, probe))
        row = {"init": label, "alpha_init": a, "lambda_init": lam}
        row |= {k: near[k] for k in ("max_abs_logit_diff", "prediction_agreement")}
        if label == "paper" and test is not None:
            row["test_acc"] = evaluate(other, test.batches(0), device=device)["acc"]
        rows.append(row)
    return rows


class Comparison:
    """What the equivalence compares: the logits, or, when the import replaced the classifier (T-CNN and CNN
    then share a new, untrained head), the features before it (`core.analysis.equivalence.features_before`)."""

    def __init__(self, imported: dict[str, Any] | None) -> None:
        replaced = bool(imported and imported.get("head_replaced"))
        self.head = imported["classifier"] if replaced and imported else None
        self.what = (
            f"features before the classifier {self.head!r} (replaced on import)" if self.head else "logits"
        )

    def __call__(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return features_before(model, x, self.head) if self.head else predict(model, x)


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the pretraining checkpoint at t1 exists and is this run's (:func:`load_source`)."""
    T.require_checkpoint(source_path(params, root), source_label(params))
    T.require_dataset(params, root)
    load_source(params, root)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
