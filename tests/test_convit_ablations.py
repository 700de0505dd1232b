"""[ConViT21] Table 3 ablation switches (gating, conv_init, freeze_gpsa) and the small ConViT for 28 px inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.models.factory import build
from core.models.spec import build_from_spec, make_model_spec
from core.nn.gpsa import GPSA
from core.nn.gpsa_convit import ConvitGPSA
from core.reparam import gpsa_modules
from core.training.optim import build_adamw


def _step(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """One AdamW step of the fine-tuning recipe (gate lr 0.1) on a random batch; returns the params before."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_adamw(model, lr=1e-2, gate_lr=0.1, weight_decay=0.05)
    model.train()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return before


def _changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}


def test_convit_fmnist_is_small_and_runs_on_28px() -> None:
    m = build("convit", "convit_fmnist", 10, in_chans=1)
    assert tuple(m.patch_embed.grid_size) == (7, 7)
    layers = gpsa_modules(m)
    assert len(layers) == 3 and all(isinstance(g, ConvitGPSA) and g.grid_size == (7, 7) for _, g in layers)
    assert sum(p.numel() for p in m.parameters()) < 300_000
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def _kw(kind: str) -> dict:
    """timm ResNets zero-init the last BN of each block: no gradient would reach the GPSA at the start."""
    return {} if kind == "convit" else {"zero_init_last": False}


SLOW_RESNET = pytest.mark.slow


@pytest.mark.parametrize(
    "kind,arch", [("convit", "convit_fmnist"), pytest.param("tcnn", "resnet10_cifar", marks=SLOW_RESNET)]
)
def test_gating_freeze0_pins_every_gate_at_one_half(kind: str, arch: str) -> None:
    """[ConViT21] Table 3 footnote: "no gating" = all lambda frozen at 0, so sigma(lambda) = 1/2."""
    torch.manual_seed(0)
    m = build(kind, arch, 10, in_chans=1, gating="freeze0", **_kw(kind))
    layers = gpsa_modules(m)
    assert layers
    for _, g in layers:
        assert not g.gating_param.requires_grad
        assert torch.equal(g.gate().detach(), torch.full_like(g.gate(), 0.5))
    before = _step(m)
    changed = _changed(m, before)
    gates = {f"{n}.gating_param" for n, _ in layers}
    assert not gates & changed  # the optimizer left them alone ...
    assert {f"{n}.qkv_weight" for n, _ in layers} <= changed  # ... while the rest of the GPSA trains
    trained = build(kind, arch, 10, in_chans=1, **_kw(kind))  # control: without the switch the gates do move
    assert gates <= _changed(trained, _step(trained))


@pytest.mark.parametrize(
    "kind,arch",
    [
        ("convit", "convit_fmnist"),
        pytest.param("tcnn", "resnet10_cifar", marks=SLOW_RESNET),
        pytest.param("psa", "resnet10_cifar", marks=SLOW_RESNET),
    ],
)
def test_freeze_gpsa_freezes_every_attention_parameter(kind: str, arch: str) -> None:
    torch.manual_seed(1)
    m = build(kind, arch, 10, in_chans=1, freeze_gpsa=True, **_kw(kind))
    layers = gpsa_modules(m)
    frozen = {f"{n}.{p}" for n, g in layers for p, _ in g.named_parameters()}
    assert frozen and all(not p.requires_grad for _, g in layers for p in g.parameters())
    changed = _changed(m, _step(m))
    assert not frozen & changed
    assert changed  # everything else trains (e.g. the head)
    assert any(n.startswith(("head", "fc")) for n in changed)


def test_conv_init_off_drops_the_locality_init() -> None:
    """conv_init=false: v_pos and W_val get the ViT init (std 0.02) instead of [ConViT21] Eq. 5's: the positional
    attention starts nearly uniform instead of peaked on the kernel taps, and W_val is no identity."""
    torch.manual_seed(2)
    on = build("convit", "convit_fmnist", 10, in_chans=1)
    off = build("convit", "convit_fmnist", 10, in_chans=1, conv_init=False)
    for (_, a), (_, b) in zip(gpsa_modules(on), gpsa_modules(off), strict=True):
        assert a.positional == "softplus" and b.positional == "linear"
        dv = a.v_dim
        eye = torch.eye(dv)
        assert torch.equal(a.qkv_weight[-dv:].detach(), eye) and not torch.allclose(b.qkv_weight[-dv:], eye)
        assert b.qkv_weight[-dv:].std().item() == pytest.approx(0.02, rel=0.2)
        assert b.pos_weight.abs().max().item() < 0.1  # normal, std 0.02 (timm truncates at +-2 absolute)
        pa, pb = a.positional_attention(7, 7), b.positional_attention(7, 7)  # [heads, 49, 49]
        assert pa.max() > 0.5 > 0.25 > pb.max()  # peaked on the taps vs spread out (uniform: 1/49)
        assert torch.allclose(pb.sum(-1), torch.ones(pb.shape[:2]), atol=1e-5)
    with pytest.raises(ValueError, match="conv_init=false needs positional='linear'"):
        build("convit", "convit_fmnist", 10, conv_init=False, positional="softplus")
    with pytest.raises(ValueError, match="options.conv_init: applies to kinds"):
        build("tcnn", "resnet10_cifar", 10, conv_init=False)


def test_switches_survive_the_checkpoint_round_trip() -> None:
    """The switches act at build time: a model rebuilt from its spec is frozen the same way."""
    torch.manual_seed(3)
    opts = {"gating": "freeze0", "freeze_gpsa": False, "conv_init": False}
    m = build("convit", "convit_fmnist", 10, in_chans=1, **opts)
    _step(m)
    spec = make_model_spec("convit", "convit_fmnist", 10, 1, opts)
    r = build_from_spec(spec)
    r.load_state_dict(m.state_dict())
    frozen = {n for n, p in r.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, p in m.named_parameters() if not p.requires_grad} and frozen
    x = torch.randn(2, 1, 28, 28)
    m.eval(), r.eval()
    with torch.no_grad():
        assert torch.equal(m(x), r(x))
    assert all(isinstance(g, GPSA) and g.gating_param.abs().max() == 0 for _, g in gpsa_modules(r))
