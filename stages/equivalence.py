"""How close the reparam stage's converted network is to the CNN it came from: what ``equivalence.json`` holds.

[TCNN21] Sec. 2: the GPSA conversion preserves the CNN's function exactly only for large alpha and lambda, and
at the paper's alpha = lambda = 1 starts near it. On one probe batch of validation images this measures the
max / mean |logit diff| of the configured conversion, of the other stride mode and of the paper's and a large
init (`core.analysis.equivalence`), then the validation and test accuracy of both networks.

It lives beside the stages, not in `core.analysis`: it loads and feeds data the way every stage does
(`stages.harness.training`), and it evaluates networks (`core.training.loop`), a layer `core.analysis` may
not import.
"""

from __future__ import annotations

from typing import Any

import torch

from core.analysis.equivalence import LARGE_INIT, PAPER_INIT, agreement, features_before
from core.config import Params
from core.data import first_batch
from core.models.kinds import Conversion
from core.models.reparam import attention_modules, gpsa_modules, to_attention
from core.models.reparameterize import Reparameterized
from core.training.loop import evaluate, predict
from stages.harness import training as T
from stages.pretrained import Pretrained

__all__ = ["PROBE", "Comparison", "measure"]

PROBE = 256  # images in the equivalence batch


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


def measure(
    params: Params, source: Pretrained, made: Reparameterized, loaders: T.Loaders, device: torch.device,
    moved: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The equivalence report of ``made`` (the network converted from the t1 checkpoint's CNN, ``source``) in
    eval mode, where BN uses running statistics, so both networks compute deterministic functions: how close
    it is on the probe batch, the optimizer state ``moved`` onto new names, the other stride mode and inits
    (a network converted to attention only) and the accuracies."""
    probe = first_batch(loaders.val if loaders.val is not None else loaders.test, PROBE)
    cnn = source.model.to(device)
    made.model.to(device)
    compare = Comparison(source.ckpt.get("source"))
    logits_cnn = compare(cnn, probe)
    report = _equivalence(params, source.ckpt, cnn, made, probe, logits_cnn, compare)
    report["optimizer_state_renamed"] = {k: v for k, v in moved.items() if k != v}
    if made.conversion is not None:
        report.update(_other_modes(params, cnn, made.conversion, probe, logits_cnn, loaders, device, compare))
    report.update(_accuracies(cnn, made.model, loaders, device))
    return report


def _equivalence(
    params: Params, ckpt: dict[str, Any], cnn: torch.nn.Module, made: Reparameterized, probe: torch.Tensor,
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
    params: Params, cnn: torch.nn.Module, conversion: Conversion, probe: torch.Tensor, logits_cnn: torch.Tensor,
    loaders: T.Loaders, device: torch.device, compare: Comparison,
) -> dict[str, Any]:  # fmt: skip
    """The same distance with the other stride mode and at the paper's and a large init (`_other_inits`)."""
    other = "s1" if params.reparam.stride_mode == "exact" else "exact"
    out: dict[str, Any] = {}
    try:
        alt = to_attention(cnn, conversion.replace(stride_mode=other)).to(device)
        out[f"max_abs_logit_diff_{other}"] = agreement(logits_cnn, compare(alt, probe))["max_abs_logit_diff"]
    except (ValueError, NotImplementedError) as err:
        out[f"max_abs_logit_diff_{other}"] = None
        out[f"{other}_error"] = str(err)
    out["inits"] = _other_inits(cnn, params, conversion, probe, logits_cnn, loaders.test, device, compare)
    return out


def _other_inits(
    cnn: torch.nn.Module, params: Params, conversion: Conversion, probe: torch.Tensor, logits_cnn: torch.Tensor,
    test: Any, device: torch.device, compare: Comparison,
) -> list[dict[str, Any]]:  # fmt: skip
    """How far the converted network is from the CNN at the paper's init and at a large init, next to the
    configured one: max |logit diff| and prediction agreement on the probe batch, and at the paper's init the
    test accuracy right after reparameterization (what the paper's fine-tuning starts from)."""
    configured = (params.reparam.alpha_init, params.reparam.lambda_init)
    rows = []
    for label, (a, lam) in (("paper", PAPER_INIT), ("large", LARGE_INIT)):
        if (a, lam) == configured:
            continue
        other = to_attention(cnn, conversion.replace(alpha_init=a, lambda_init=lam))
        other = other.to(device).eval()
        near = agreement(logits_cnn, compare(other, probe))
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
