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

from core.config import Params
from core.models.reparameterize import Reparameterized, reparameterize, state_kept_by_name
from core.training.checkpoint import atomic_save
from core.training.loop import seed_everything, select_device
from core.training.optim import map_state_to_tcnn
from core.utils.atomic import atomic_write_json
from core.utils.hashing import derive_seed, file_digest
from stages.equivalence import measure
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main
from stages.pretrained import Pretrained, load_source, source_label, source_path

NAME = "reparam"


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Convert the t1 checkpoint (module docstring), measure how far the result is from the CNN
    (`stages.equivalence.measure`), and write ``tcnn.pt`` and ``equivalence.json``; returns the equivalence
    report."""
    t_wall = time.perf_counter()
    root = Path(root)
    source = load_source(params, root)  # read and checked once (its kind, spec, network code), CNN rebuilt
    ds = T.datasets(params, root)
    device = select_device()
    seed_everything(derive_seed(params.seed, NAME))  # the new W_qry, W_key (and such) draw from this stream
    made, state, moved, note = _convert(params, source)
    size = int(source.ckpt.get("image_size") or ds.image_size)
    loaders = T.loaders(params, ds, batch_size=T.EVAL_BATCH, seed=params.seed, augment=None, size=size)
    report = measure(params, source, made, loaders, device, moved)
    if note:
        report["note"] = note
    report["wall_s"] = time.perf_counter() - t_wall
    _write(root, source, made, ds, size, source.carry(state, moved))
    atomic_write_json(root / chain.run_dir(NAME) / "equivalence.json", report)
    return report


def _convert(
    params: Params, source: Pretrained
) -> tuple[Reparameterized, dict[str, Any], dict[str, str], str | None]:
    """The kind's network made from the CNN (`core.models.reparameterize`) and the optimizer state for
    "continue" fine-tuning, keyed by its parameter names ([TCNN21] Table 3)."""
    kind, state_in = params.model.record, source.optimizer_state()
    try:
        made = reparameterize(source.model, source.spec, kind, params.reparam, params.model.options)
    except ValueError as err:
        raise StageError(
            f"reparam: cannot convert {source.spec['arch']!r} to kind {kind.name!r} ({err})"
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
        raise StageError(f"{source.path}: optimizer state does not map onto the T-CNN ({err})") from None
    return made, state, moved, note


def _write(
    root: Path, source: Pretrained, made: Reparameterized, ds: Any, size: int, carry: dict[str, Any] | None
) -> None:
    """``tcnn.pt``: the converted network, where it came from, and what "continue" fine-tuning carries."""
    src, ckpt = source.path, source.ckpt
    out = {
        "kind": "model",
        "model": T.cpu_state(made.model),
        "model_spec": made.spec,
        "normalization": ckpt.get("normalization", {"mean": ds.mean, "std": ds.std}),
        "image_size": size,
        "source": {
            "checkpoint": str(src.relative_to(root)) if src.is_relative_to(root) else str(src),
            "sha256": file_digest(src),
            "epoch": int(ckpt["epoch"]),
        },
        "carry": carry,
    }
    out_dir = root / chain.run_dir(NAME)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(out, out_dir / "tcnn.pt")


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the pretraining checkpoint at t1 exists and is this run's (:func:`load_source`),
    and the params convert it (a ``reparam.stages`` pattern that matches no conv is refused here, not after
    the runs opened; :func:`run` reseeds before its own conversion)."""
    T.require_checkpoint(source_path(params, root), source_label(params))
    T.require_dataset(params, root)
    _convert(params, load_source(params, root))


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
