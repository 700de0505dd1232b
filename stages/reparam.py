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

equivalence.json ([TCNN21] Sec. 2: the GPSA conversion preserves the CNN's function exactly only for large
alpha and lambda, and at the paper's alpha = lambda = 1 starts near it): on one probe batch of validation
images, the max / mean |logit diff| of the configured conversion, of the other stride mode and of the paper's
and a large init (`core.analysis.equivalence`), then the validation and test accuracy of both networks
(:func:`measure`; it evaluates networks, which `core.analysis` may not, so it lives here).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from core.analysis.equivalence import LARGE_INIT, PAPER_INIT, agreement, features_before
from core.config import Params, ReparamConfig
from core.data import first_batch
from core.models.conversion import attention_modules, gpsa_modules, to_attention
from core.models.kinds import Conversion, ModelKind
from core.models.reparameterize import Reparameterized, reparameterize, state_kept_by_name
from core.training.checkpoint import atomic_save
from core.training.environment import seed_everything, select_device
from core.training.model_eval import evaluate, predict
from core.training.optim import map_state_to_tcnn
from core.utils.atomic import atomic_write_json
from core.utils.hashing import derive_seed, file_digest
from stages.harness import chain
from stages.harness import training as T
from stages.harness.runner import StageError, stage_main
from stages.harness.t1_checkpoint import Pretrained, Wanted, load_source

NAME = "reparam"
PROBE = 256  # images in the equivalence batch


class Job:
    """What the stage reads of ``params``, read once, at the top of :func:`run`, and handed on in narrow pieces,
    so that no step below reads params again or looks the model kind up a second time: the t1 checkpoint it
    converts (`Wanted`: where it is and the network it must be, model.kind's record among it), the reparam
    section, the seed, the loaders' workers, and what the equivalence report says the run asked for."""

    def __init__(self, params: Params, root: Path) -> None:
        self.t1 = Wanted.of(params, root)
        self.reparam = params.reparam
        self.seed = params.seed
        self.num_workers = params.data.num_workers
        self.epoch = params.t1()  # reparam.epoch, or 0 for an imported CNN
        self.imported = params.imports_cnn
        self.normalization = T.input_normalization(params)

    @property
    def kind(self) -> ModelKind:
        """model.kind's record (looked up once, by `Wanted.of`)."""
        return self.t1.cnn.kind


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Convert the t1 checkpoint (module docstring), measure how far the result is from the CNN
    (:func:`measure`), and write ``tcnn.pt`` and ``equivalence.json``; returns the equivalence
    report."""
    t_wall = time.perf_counter()
    root = Path(root)
    job = Job(params, root)
    source = load_source(job.t1)  # read and checked once (its kind, spec, network code), CNN rebuilt
    ds = T.datasets(params, root)
    device = select_device()
    seed_everything(derive_seed(job.seed, NAME))  # the new W_qry, W_key (and such) draw from this stream
    made, state, moved, note = _convert(source, job.kind, job.reparam, job.t1.cnn.options)
    size = int(source.ckpt.get("image_size") or ds.image_size)
    loaders = T.loaders(ds, batch_size=T.EVAL_BATCH, seed=job.seed, augment=None, size=size,
                        num_workers=job.num_workers)  # fmt: skip
    report = measure(job, source, made, loaders, device, moved)
    if note:
        report["note"] = note
    report["wall_s"] = time.perf_counter() - t_wall
    _write(root, source, made, ds, size, source.carry(state, moved))
    atomic_write_json(root / chain.run_dir(NAME) / "equivalence.json", report)
    return report


def _convert(
    source: Pretrained, kind: ModelKind, reparam: ReparamConfig, options: dict[str, Any]
) -> tuple[Reparameterized, dict[str, Any], dict[str, str], str | None]:
    """The network of ``kind`` made from the CNN (`core.models.reparameterize`, with the ``reparam`` section and
    model.options) and the optimizer state for "continue" fine-tuning, keyed by its parameter names ([TCNN21]
    Table 3)."""
    state_in = source.optimizer_state()
    try:
        made = reparameterize(source.model, source.spec, kind, reparam, options)
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


class Comparison:
    """What the equivalence compares, on the probe batch: the logits, or, when the import replaced the classifier
    (T-CNN and CNN then share a new, untrained head), the features before it
    (`core.analysis.equivalence.features_before`). It holds the probe and the CNN's output on it, computed once,
    so every network is held against the CNN in one call (:meth:`near`)."""

    def __init__(self, imported: dict[str, Any] | None, cnn: torch.nn.Module, probe: torch.Tensor) -> None:
        replaced = bool(imported and imported.get("head_replaced"))
        self.head = imported["classifier"] if replaced and imported else None
        self.what = (
            f"features before the classifier {self.head!r} (replaced on import)" if self.head else "logits"
        )
        self.probe = probe
        self.cnn_out = self(cnn, probe)

    def __call__(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return features_before(model, x, self.head) if self.head else predict(model, x)

    def near(self, model: torch.nn.Module) -> dict[str, Any]:
        """How close ``model`` computes the CNN's function on the probe batch
        (`core.analysis.equivalence.agreement`)."""
        return agreement(self.cnn_out, self(model, self.probe))


def measure(
    job: Job, source: Pretrained, made: Reparameterized, loaders: T.Loaders, device: torch.device,
    moved: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The equivalence report of ``made`` (the network converted from the t1 checkpoint's CNN, ``source``) in
    eval mode, where BN uses running statistics, so both networks compute deterministic functions: how close
    it is on the probe batch, the optimizer state ``moved`` onto new names, the other stride mode and inits
    (a network converted to attention only) and the accuracies."""
    probe = first_batch(loaders.val if loaders.val is not None else loaders.test, PROBE)
    cnn = source.model.to(device)
    made.model.to(device)
    compare = Comparison(source.ckpt.get("source"), cnn, probe)
    report = _equivalence(job, source.ckpt, cnn, made, compare)
    report["optimizer_state_renamed"] = {k: v for k, v in moved.items() if k != v}
    if made.conversion is not None:
        report.update(_other_modes(cnn, made.conversion, loaders.test, device, compare))
    report.update(_accuracies(cnn, made.model, loaders, device))
    return report


def _equivalence(
    job: Job, ckpt: dict[str, Any], cnn: torch.nn.Module, made: Reparameterized, compare: Comparison
) -> dict[str, Any]:
    """How close the converted network computes the CNN's function on the probe batch ([TCNN21] Sec. 2), after
    what the run asked for (``job``)."""
    tcnn, r = made.model, job.reparam
    return {
        "reparam_epoch": job.epoch,
        "imported": job.imported,
        "source": ckpt.get("source"),
        "normalization": job.normalization,
        "compared": compare.what,
        "alpha_init": r.alpha_init,
        "lambda_init": r.lambda_init,
        "stride_mode": r.stride_mode,
        "stages": list(r.stages),
        "kind": job.kind.name,
        "converted": made.converted,
        "probe_images": int(compare.probe.shape[0]),
        **compare.near(tcnn),
        "gpsa_layers": [name for name, _ in gpsa_modules(tcnn)],
        "attention_layers": [name for name, _ in attention_modules(tcnn)],
        "params_cnn": sum(p.numel() for p in cnn.parameters()),
        "params_tcnn": sum(p.numel() for p in tcnn.parameters()),
    }


def _other_modes(
    cnn: torch.nn.Module, conversion: Conversion, test: Any, device: torch.device, compare: Comparison
) -> dict[str, Any]:
    """The same distance with the other stride mode than ``conversion``'s (the one that made the network) and
    at the paper's and a large init (`_other_inits`)."""
    other = "s1" if conversion.stride_mode == "exact" else "exact"
    out: dict[str, Any] = {}
    try:
        alt = to_attention(cnn, conversion.replace(stride_mode=other)).to(device)
        out[f"max_abs_logit_diff_{other}"] = compare.near(alt)["max_abs_logit_diff"]
    except (ValueError, NotImplementedError) as err:
        out[f"max_abs_logit_diff_{other}"] = None
        out[f"{other}_error"] = str(err)
    out["inits"] = _other_inits(cnn, conversion, test, device, compare)
    return out


def _other_inits(
    cnn: torch.nn.Module, conversion: Conversion, test: Any, device: torch.device, compare: Comparison
) -> list[dict[str, Any]]:
    """How far the converted network is from the CNN at the paper's init and at a large init, next to the
    configured one (``conversion``'s, the reparam section's): max |logit diff| and prediction agreement on the
    probe batch, and at the paper's init the test accuracy right after reparameterization (what the paper's
    fine-tuning starts from)."""
    configured = (conversion.alpha_init, conversion.lambda_init)
    rows = []
    for label, (a, lam) in (("paper", PAPER_INIT), ("large", LARGE_INIT)):
        if (a, lam) == configured:
            continue
        other = to_attention(cnn, conversion.replace(alpha_init=a, lambda_init=lam))
        other = other.to(device).eval()
        near = compare.near(other)
        row = {"init": label, "alpha_init": a, "lambda_init": lam}
        row |= {k: near[k] for k in ("max_abs_logit_diff", "prediction_agreement")}
        if label == "paper" and test is not None:
            row["test_acc"] = evaluate(other, test.batches(0), device=device)["acc"]
        rows.append(row)
    return rows


def _accuracies(
    cnn: torch.nn.Module, tcnn: torch.nn.Module, loaders: T.Loaders, device: torch.device
) -> dict[str, Any]:
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


def check(params: Params, root: Path = Path(".")) -> None:
    """Before any run opens: the pretraining checkpoint at t1 exists and is this run's (:func:`load_source`),
    and the params convert it (a ``reparam.stages`` pattern that matches no conv is refused here, not after
    the runs opened; :func:`run` reseeds before its own conversion)."""
    want = Wanted.of(params, root)
    T.require_checkpoint(want.path, want.label)
    T.require_dataset(params, root)
    _convert(load_source(want), want.cnn.kind, params.reparam, want.cnn.options)


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check)


if __name__ == "__main__":
    sys.exit(main())
