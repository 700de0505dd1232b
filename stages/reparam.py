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

from core.config import Params
from core.models.reparameterize import Reparameterized, reparameterize, state_kept_by_name
from core.models.spec import build_from_spec
from core.training.checkpoint import atomic_save
from core.training.loop import seed_everything, select_device
from core.training.optim import map_state_to_tcnn, named_state
from core.utils.atomic import atomic_write_json
from core.utils.hashing import derive_seed, file_digest
from stages.equivalence import measure
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main
from stages.pretrained import load_source, source_label, source_path

NAME = "reparam"


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Convert the t1 checkpoint (module docstring), measure how far the result is from the CNN
    (`stages.equivalence.measure`), and write ``tcnn.pt`` and ``equivalence.json``; returns the equivalence
    report."""
    t_wall = time.perf_counter()
    root = Path(root)
    src = source_path(params, root)
    ckpt = load_source(params, root)
    cnn = _load_cnn(ckpt, src)
    ds = T.datasets(params, root)
    device = select_device()
    seed_everything(derive_seed(params.seed, NAME))  # the new W_qry, W_key (and such) draw from this stream
    made, state, moved, note = _convert(params, cnn, ckpt, src)
    size = ckpt.get("image_size") or ds.image_size
    loaders = T.loaders(params, ds, batch_size=T.EVAL_BATCH, seed=params.seed, augment=None, size=size)
    report = measure(params, ckpt, cnn, made, loaders, device, moved)
    if note:
        report["note"] = note
    report["wall_s"] = time.perf_counter() - t_wall
    _write(root, src, ckpt, made.spec, made.model, ds, int(size), state, moved)
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
) -> tuple[Reparameterized, dict[str, Any], dict[str, str], str | None]:
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
        kept = state_kept_by_name(state_in, made.model)
        note = f"{note}; no optimizer state for {sorted(set(state_in) - set(kept))}"
        state_in = kept
    made.model.eval()
    try:
        state, moved = map_state_to_tcnn(state_in, made.model)
    except KeyError as err:
        raise StageError(f"{src}: optimizer state does not map onto the T-CNN ({err})") from None
    return made, state, moved, note


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


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the pretraining checkpoint at t1 exists and is this run's (:func:`load_source`),
    and the params convert it (a ``reparam.stages`` pattern that matches no conv is refused here, not after
    the runs opened; :func:`run` reseeds before its own conversion)."""
    src = source_path(params, root)
    T.require_checkpoint(src, source_label(params))
    T.require_dataset(params, root)
    ckpt = load_source(params, root)
    _convert(params, _load_cnn(ckpt, src), ckpt, src)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
