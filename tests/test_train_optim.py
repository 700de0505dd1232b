"""core.training.optim and model helpers: the schedule, parameter groups, optimizer-state transfer, stochastic depth."""

from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.layers import DropPath

from core.models.factory import build, set_drop_path
from core.reparam import to_tcnn
from core.training.optim import (
    WarmupCosine,
    build_adamw,
    build_sgd,
    load_named_state,
    map_state_to_tcnn,
    named_state,
    optimizer_param_names,
    param_groups,
)


def _opt(lrs=(0.4,)) -> torch.optim.SGD:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs]
    return torch.optim.SGD(groups, lr=lrs[0])


def test_warmup_cosine_hand_computed_values() -> None:
    opt = _opt((0.4, 0.1))
    s = WarmupCosine(opt, total_steps=14, warmup_steps=4)
    lrs = []
    for _ in range(14):
        lrs.append([g["lr"] for g in opt.param_groups])
        s.step()
    # warmup: (s + 1) / 4 of the base lr
    assert [r[0] for r in lrs[:4]] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    # cosine over the 10 remaining steps: step 4 -> full lr, step 9 -> half, step 13 -> (1 + cos(0.9 pi)) / 2
    assert lrs[4][0] == pytest.approx(0.4)
    assert lrs[9][0] == pytest.approx(0.2)
    assert lrs[13][0] == pytest.approx(0.4 * (1 + math.cos(0.9 * math.pi)) / 2)
    # every group follows the same shape on its own base lr
    assert all(b == pytest.approx(a / 4) for a, b in lrs)
    assert all(x[0] >= y[0] for x, y in zip(lrs[4:], lrs[5:]))


def test_warmup_cosine_state_restores_the_lr_sequence() -> None:
    opt_a, opt_b = _opt(), _opt()
    a = WarmupCosine(opt_a, total_steps=50, warmup_steps=7)
    for _ in range(23):
        a.step()
    b = WarmupCosine(opt_b, total_steps=1, warmup_steps=0)
    b.load_state_dict(a.state_dict())
    for _ in range(20):
        assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]
        a.step()
        b.step()


def test_param_groups_cnn_no_decay_on_norms_and_biases() -> None:
    cnn = build("cnn", "resnet10_cifar", 10, in_chans=1)
    groups = {g["name"]: g for g in param_groups(cnn, lr=0.1, weight_decay=5e-4)}
    names = {id(p): n for n, p in cnn.named_parameters()}
    no_decay = {names[id(p)] for p in groups["no_decay"]["params"]}
    decay = {names[id(p)] for p in groups["decay"]["params"]}
    assert "layer1.0.bn1.weight" in no_decay and "fc.bias" in no_decay
    assert "layer1.0.conv1.weight" in decay and "fc.weight" in decay
    assert groups["no_decay"]["weight_decay"] == 0.0 and groups["decay"]["weight_decay"] == 5e-4
    assert decay | no_decay == set(dict(cnn.named_parameters()))
    assert "gate" not in groups


def test_adamw_groups_for_a_tcnn_follow_the_fresh_recipe() -> None:
    tcnn = to_tcnn(build("cnn", "resnet10_cifar", 10, in_chans=1))
    opt = build_adamw(tcnn, lr=1e-4, gate_lr=0.1, weight_decay=0.05)
    names = dict(zip(optimizer_param_names(opt, tcnn), [g for g in opt.param_groups for _ in g["params"]]))
    g = names["layer4.0.conv2.gating_param"]
    assert g["name"] == "gate" and g["lr"] == 0.1 and g["weight_decay"] == 0.0
    for pos in ("layer4.0.conv2.pos_alpha", "layer4.0.conv2.pos_center"):
        assert names[pos]["name"] == "no_decay" and names[pos]["lr"] == 1e-4
    for w in ("layer4.0.conv2.weight", "layer4.0.conv2.qkv_weight", "layer1.0.conv1.weight"):
        assert names[w]["name"] == "decay" and names[w]["weight_decay"] == 0.05
    assert names["layer4.0.bn2.bias"]["weight_decay"] == 0.0
    assert len(names) == len(list(tcnn.parameters()))


def test_frozen_parameters_are_left_out() -> None:
    tcnn = to_tcnn(build("cnn", "resnet10_cifar", 10, in_chans=1))
    for n, p in tcnn.named_parameters():
        if n.endswith("qkv_weight"):
            p.requires_grad_(False)
    opt = build_sgd(tcnn, lr=0.1, momentum=0.9, weight_decay=0.0)
    assert not any(n.endswith("qkv_weight") for n in optimizer_param_names(opt, tcnn))


def test_momentum_moves_onto_the_gpsa_weight_unchanged() -> None:
    torch.manual_seed(0)
    cnn = build("cnn", "resnet10_cifar", 10, in_chans=1)
    opt = build_sgd(cnn, lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(2):
        loss = cnn(torch.randn(4, 1, 28, 28)).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    tcnn = to_tcnn(cnn)
    state, moved = map_state_to_tcnn(named_state(opt.state_dict(), optimizer_param_names(opt, cnn)), tcnn)
    opt2 = build_sgd(tcnn, lr=0.1, momentum=0.9, weight_decay=5e-4)
    loaded = load_named_state(opt2, tcnn, state)
    assert set(loaded) == set(dict(cnn.named_parameters()))
    buf_cnn = opt.state[cnn.layer4[0].conv2.weight]["momentum_buffer"]
    buf_tcnn = opt2.state[tcnn.layer4[0].conv2.weight]["momentum_buffer"]
    assert torch.equal(buf_cnn, buf_tcnn)
    assert tcnn.layer4[0].conv2.qkv_weight not in opt2.state  # new parameter: empty state
    state["nonexistent.weight"] = state.pop("fc.weight")
    with pytest.raises(KeyError, match="nonexistent.weight"):
        map_state_to_tcnn(state, tcnn)


def test_set_drop_path_matches_timms_own_rule() -> None:
    ours = build("cnn", "resnet18_cifar", 10, in_chans=1)
    touched = set_drop_path(ours, 0.2)
    ref = timm.create_model("resnet18", drop_path_rate=0.2)  # timm's linear decay over its 8 blocks

    def rates(m):
        return [b.drop_path.drop_prob if isinstance(b.drop_path, DropPath) else 0.0
                for b in m.modules() if hasattr(b, "drop_path") and not isinstance(b, DropPath)]  # fmt: skip

    assert touched == 8
    assert rates(ours) == pytest.approx(rates(ref))
    set_drop_path(ours, 0.0)
    assert rates(ours) == [0.0] * 8


def test_state_put_in_before_the_model_moves_follows_it() -> None:
    """Found on CUDA (scripts/gpu_check.sh): "continue" fine-tuning loads the carried SGD momentum while the
    model is on the CPU, then fit moves the model to the GPU; the momentum stayed behind and the first step
    failed ("found at least two devices"). Here the parameters sit on the "meta" device (the GPU's stand-in)
    and the state on the CPU: the state moves to the parameters, the scalar step stays on the CPU, where
    PyTorch keeps it."""
    from core.training.optim import state_to_parameter_devices

    model = torch.nn.Linear(3, 2, device="meta")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cpu_state = {n: {"step": torch.tensor(3.0), "exp_avg": torch.ones(p.shape), "exp_avg_sq": torch.ones(p.shape)}
                 for n, p in model.named_parameters()}  # fmt: skip
    for n, p in model.named_parameters():
        opt.state[p] = dict(cpu_state[n])
    assert opt.state[model.weight]["exp_avg"].device.type == "cpu"
    state_to_parameter_devices(opt)
    for p in model.parameters():
        assert (
            opt.state[p]["exp_avg"].device.type == "meta" and opt.state[p]["exp_avg_sq"].device.type == "meta"
        )
        assert opt.state[p]["step"].device.type == "cpu"
