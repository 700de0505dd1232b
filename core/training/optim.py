"""Optimizers, parameter groups and the per-step warmup + cosine schedule of the training stages.

Recipes:
- CNN pretraining ([TCNN21] Sec. 5): SGD with momentum, linear warmup then cosine decay, planned over the whole
  run (t1 + t2 epochs) and stepped once per optimizer step.
- T-CNN fine-tuning, "fresh" ([TCNN21] Sec. 3): AdamW, warmup to lr x batch/1024 then cosine, a separate
  learning rate (0.1) for the gating parameters lambda (Eq. 7), no weight decay on alpha, lambda and the
  attention centres (nor on norms and biases).
- "continue" ([TCNN21] Table 3): the CNN's SGD keeps its state and schedule across the reparameterization; the
  momentum of each converted conv filter moves to the GPSA parameter that now holds the filter
  (:func:`map_state_to_tcnn`) and the new GPSA parameters start with empty state.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from core.nn.attention_layers import gpsa_modules

# ---------------------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------------------


class WarmupCosine:
    """Per-step learning rate: linear warmup to each group's `base_lr`, then cosine decay to `min_factor`.

    factor(s) = (s + 1) / W                                  for s < W (warmup steps)
              = m + (1 - m) * (1 + cos(pi * (s - W) / (T - W))) / 2     otherwise (T = total steps)

    The lr of every step is a pure function of the step counter, so the state is one integer and a resumed
    (or "continued", [TCNN21] Table 3) run sets exactly the lr an uninterrupted run sets.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        warmup_steps: int = 0,
        min_factor: float = 0.0,
        start_step: int = 0,
    ) -> None:
        if total_steps <= 0:
            raise ValueError(f"total_steps must be positive, got {total_steps}")
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("base_lr", group["lr"])
        self.total_steps = int(total_steps)
        self.warmup_steps = int(min(max(warmup_steps, 0), total_steps))
        self.min_factor = float(min_factor)
        self.last_step = int(start_step)
        self.apply()

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.min_factor + (1.0 - self.min_factor) * 0.5 * (1.0 + math.cos(math.pi * t))

    def apply(self) -> None:
        f = self.factor(self.last_step)
        for group in self.optimizer.param_groups:
            group["lr"] = group["base_lr"] * f

    def step(self) -> None:
        self.last_step += 1
        self.apply()

    def lr(self) -> float:
        """The lr of the first parameter group for the next step."""
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "warmup_cosine",
            "total_steps": self.total_steps,
            "warmup_steps": self.warmup_steps,
            "min_factor": self.min_factor,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_steps = int(state["total_steps"])
        self.warmup_steps = int(state["warmup_steps"])
        self.min_factor = float(state["min_factor"])
        self.last_step = int(state["last_step"])
        self.apply()


# ---------------------------------------------------------------------------------------------------------
# Parameter roles and groups
# ---------------------------------------------------------------------------------------------------------


def gpsa_parameter_roles(model: nn.Module) -> dict[str, str]:
    """Full parameter name -> "gate" (lambda, Eq. 7) or "positional" (alpha, centres) for every GPSA layer.

    Uses `GPSA.positional_parameter_names()` and `GPSA.gating_parameter_names()` (names local to the GPSA;
    only those present count). Returns {} for models without GPSA layers (plain CNNs).
    """
    roles: dict[str, str] = {}
    for prefix, module in gpsa_modules(model):
        present = {n for n, _ in module.named_parameters(recurse=False)}
        gates = set(module.gating_parameter_names())
        for local in (set(module.positional_parameter_names()) | gates) & present:
            roles[f"{prefix}.{local}" if prefix else local] = "gate" if local in gates else "positional"
    return roles


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Norm scales/shifts and biases get no weight decay (the usual rule: every tensor of rank <= 1)."""
    return param.ndim <= 1 or name.endswith(".bias")


def param_groups(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float,
    gate_lr: float | None = None,
) -> list[dict[str, Any]]:
    """Groups "decay", "no_decay" and (when `gate_lr` is given and the model has GPSA layers) "gate".

    Parameters with `requires_grad=False` are left out. Without `gate_lr`, gates join "no_decay" at `lr`
    (the "continue" recipe keeps one optimizer and one lr for everything, [TCNN21] Table 3).
    """
    roles = gpsa_parameter_roles(model)
    groups: dict[str, list[torch.nn.Parameter]] = {"decay": [], "no_decay": [], "gate": []}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        role = roles.get(name)
        if role == "gate" and gate_lr is not None:
            groups["gate"].append(p)
        elif role is not None or _no_decay(name, p):
            groups["no_decay"].append(p)
        else:
            groups["decay"].append(p)
    out = [
        {"name": "decay", "params": groups["decay"], "lr": lr, "weight_decay": weight_decay},
        {"name": "no_decay", "params": groups["no_decay"], "lr": lr, "weight_decay": 0.0},
    ]
    if gate_lr is not None and groups["gate"]:
        out.append({"name": "gate", "params": groups["gate"], "lr": gate_lr, "weight_decay": 0.0})
    return [g for g in out if g["params"]]


def freeze_parameters(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """requires_grad=False on every parameter whose last name component is in `names` (e.g. the GPSA's
    attention-only parameters "qkv_weight", "gating_param", "pos_alpha", "pos_center"); returns them."""
    wanted = set(names)
    frozen = []
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in wanted:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


def build_sgd(model: nn.Module, *, lr: float, momentum: float, weight_decay: float) -> torch.optim.SGD:
    """SGD with momentum (Nesterov off, as in [TCNN21] Sec. 5), weight decay on weights only."""
    return torch.optim.SGD(
        param_groups(model, lr=lr, weight_decay=weight_decay), lr=lr, momentum=momentum, weight_decay=0.0
    )


def build_adamw(model: nn.Module, *, lr: float, gate_lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW of the fresh fine-tuning recipe ([TCNN21] Sec. 3): a separate lr for the gates, no decay on them."""
    return torch.optim.AdamW(
        param_groups(model, lr=lr, weight_decay=weight_decay, gate_lr=gate_lr),
        lr=lr,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        eps=1e-8,
    )


# ---------------------------------------------------------------------------------------------------------
# Optimizer state by parameter name (to move it across the reparameterization)
# ---------------------------------------------------------------------------------------------------------


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """Parameter names in the optimizer's own index order (what `optimizer.state_dict()` numbers)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def named_state(opt_state: dict[str, Any], param_names: list[str]) -> dict[str, dict[str, Any]]:
    """`optimizer.state_dict()` + the names of its indices -> {param name: per-parameter state}."""
    out: dict[str, dict[str, Any]] = {}
    for group in opt_state["param_groups"]:
        for idx in group["params"]:
            if idx in opt_state["state"]:
                out[param_names[idx]] = dict(opt_state["state"][idx])
    return out


def map_state_to_tcnn(
    state: dict[str, dict[str, Any]], tcnn: nn.Module
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Carry the CNN's per-parameter optimizer state (keyed by name) over to the T-CNN.

    `to_tcnn` keeps attribute paths and a converted conv's filter lives on as the GPSA's ``weight`` with the
    conv's name and shape (Eq. 6: W_out^h = W_filter[:, :, tap(h)] is a view of it), so every CNN parameter
    maps onto the T-CNN parameter of the same name: momentum buffers carry over unchanged. New GPSA
    parameters (W_qry, W_key, W_val, alpha, centres, lambda) get no state: SGD starts their momentum from
    their first gradient. Raises KeyError when a name or shape has no counterpart.

    Returns (state keyed by T-CNN parameter names, {cnn name: tcnn name}).
    """
    params = dict(tcnn.named_parameters())
    out: dict[str, dict[str, Any]] = {}
    moved: dict[str, str] = {}
    for name, st in state.items():
        p = params.get(name)
        if p is None:
            raise KeyError(f"optimizer state of {name!r} has no counterpart in the T-CNN")
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape != p.shape:
                raise KeyError(
                    f"optimizer state {name!r}[{key!r}] has shape {tuple(v.shape)}, the T-CNN's {tuple(p.shape)}"
                )
        out[name] = st
        moved[name] = name
    return out, moved


def state_to_parameter_devices(optimizer: torch.optim.Optimizer) -> None:
    """Move per-parameter optimizer state onto its parameter's device, in place (state put in before the model
    moved, e.g. the carried SGD momentum of "continue" fine-tuning, [TCNN21] Table 3). A scalar ``step`` stays
    where PyTorch keeps it (on the CPU unless the optimizer is capturable or fused)."""
    for p, st in optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.device != p.device and not (k == "step" and v.ndim == 0):
                st[k] = v.to(p.device)


def load_named_state(
    optimizer: torch.optim.Optimizer, model: nn.Module, state: dict[str, dict[str, Any]]
) -> list[str]:
    """Put per-parameter state (keyed by name) into `optimizer`; returns the names that received state."""
    params = dict(model.named_parameters())
    loaded = []
    for name, st in state.items():
        p = params.get(name)
        if p is None:
            raise KeyError(f"optimizer state for unknown parameter {name!r}")
        optimizer.state[p] = {  # copies: the source (e.g. another live optimizer) is never aliased
            k: (v.detach().to(p.device, copy=True) if isinstance(v, torch.Tensor) else v)
            for k, v in st.items()
        }
        loaded.append(name)
    return loaded
