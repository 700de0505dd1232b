"""How close a converted network is to the CNN it came from ([TCNN21] Sec. 2: the reparameterization preserves the
function exactly only for large alpha and lambda; at the paper's alpha = lambda = 1 it starts near it)."""

from __future__ import annotations

import torch

PAPER_INIT = (1.0, 1.0)  # [TCNN21] Sec. 2: alpha = lambda = 1 puts the T-CNN "on the verge of locality"
LARGE_INIT = (50.0, 50.0)  # large alpha and lambda: the conv's function to float precision (DESIGN section 4)


def agreement(reference: torch.Tensor, logits: torch.Tensor) -> dict[str, float | None]:
    """Max and mean |logit difference| against the reference logits, the reference's max |logit| (for scale)
    and the fraction of inputs whose top-1 prediction agrees (None values for an empty batch)."""
    if reference.shape != logits.shape:
        raise ValueError(f"agreement: logits {tuple(logits.shape)} vs reference {tuple(reference.shape)}")
    if reference.numel() == 0:
        keys = ("max_abs_logit_diff", "mean_abs_logit_diff", "max_abs_logit_cnn", "prediction_agreement")
        return dict.fromkeys(keys)
    diff = (logits - reference).abs()
    return {
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "max_abs_logit_cnn": float(reference.abs().max()),
        "prediction_agreement": float((reference.argmax(-1) == logits.argmax(-1)).float().mean()),
    }


def features_before(model: torch.nn.Module, x: torch.Tensor, module_name: str) -> torch.Tensor:
    """The input of ``model``'s submodule ``module_name`` (its classifier) on ``x``, in eval mode, fp32 on the
    CPU: what the equivalence compares when the classifier was replaced on import (T-CNN and CNN then share a
    new, untrained head, and the features before it are what the conversion must preserve)."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(module_name).register_forward_hook(
        lambda _m, inputs, _out: seen.append(inputs[0].detach())
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x.to(next(model.parameters()).device))
    finally:
        handle.remove()
        model.train(was_training)
    return seen[-1].float().cpu().flatten(1)
