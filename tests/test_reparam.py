"""to_tcnn (core.reparam): exact equivalence with the CNN, surgery contract, parameter counts ([TCNN21] Table 2)."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn as nn

import core.models.resnets  # noqa: F401  (registers the project's small nets in timm)
from core.nn.gpsa import GPSA
from core.reparam import gpsa_modules, model_stages, to_tcnn


def _nontrivial_bn(model: nn.Module, in_chans: int, hw: tuple[int, int], seed: int = 0) -> nn.Module:
    """Random BN affine parameters, then running statistics from a few train-mode batches (cumulative)."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)  # also undoes zero-init-last-BN
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) * 0.4 - 0.2)
            m.reset_running_stats()
            m.momentum = None
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(3, in_chans, *hw, generator=g))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert m.num_batches_tracked.item() == 3
            assert (m.running_var - 1).abs().max() > 1e-3 or (m.running_mean.abs().max() > 1e-3)
    return model.eval()


def _max_logit_diff(cnn: nn.Module, tcnn: nn.Module, x: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        a, b = cnn(x), tcnn(x)
    return (a - b).abs().max().item(), a.std().item()


CASES = [
    # arch, in_chans, resolutions (the second is non-square and odd-sized)
    pytest.param("resnet10_cifar", 1, [(28, 28), (27, 21)], id="resnet10_cifar"),
    pytest.param("resnet18", 3, [(48, 48), (67, 45)], id="resnet18"),
    pytest.param("resnet26d", 3, [(48, 48), (67, 45)], id="resnet26d", marks=pytest.mark.slow),
    pytest.param("seresnet18", 3, [(48, 48), (67, 45)], id="seresnet18", marks=pytest.mark.slow),
    pytest.param("resnet50", 3, [(64, 64), (67, 45)], id="resnet50", marks=pytest.mark.slow),
    pytest.param("resnetrs50", 3, [(64, 64), (67, 45)], id="resnetrs50", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,in_chans,sizes", CASES)
def test_to_tcnn_is_exact_at_large_alpha_lambda(arch: str, in_chans: int, sizes: list) -> None:
    torch.manual_seed(0)
    cnn = _nontrivial_bn(timm.create_model(arch, num_classes=10, in_chans=in_chans), in_chans, sizes[0])
    before = copy.deepcopy(cnn.state_dict())
    tcnn = to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0).eval()
    # the input model is untouched
    assert not gpsa_modules(cnn)
    assert all(torch.equal(before[k], v) for k, v in cnn.state_dict().items())
    # every k x k conv of the last stage is a GPSA at the same path, weight = filter; the strided one included
    convs = {n: m for n, m in cnn.layer4.named_modules() if isinstance(m, nn.Conv2d) and m.kernel_size[0] > 1}
    names = [n for n, _ in gpsa_modules(tcnn)]
    assert names == [f"layer4.{n}" for n in convs]
    assert any(tcnn.get_submodule(n).stride == 2 for n in names)
    for n in convs:
        assert torch.equal(tcnn.state_dict()[f"layer4.{n}.weight"], cnn.state_dict()[f"layer4.{n}.weight"])
    for hw in sizes:
        x = torch.randn(2, in_chans, *hw)
        err, scale = _max_logit_diff(cnn, tcnn, x)
        assert scale > 0.05, "logits too flat for the comparison to mean anything"
        assert err <= 1e-4, f"{arch} at {hw}: max |logit diff| = {err:.2e}"


def test_s1_and_paper_init_are_not_function_preserving() -> None:
    torch.manual_seed(1)
    cnn = _nontrivial_bn(timm.create_model("resnet10_cifar", num_classes=10, in_chans=1), 1, (28, 28))
    x = torch.randn(4, 1, 28, 28)
    err_exact, _ = _max_logit_diff(cnn, to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0), x)
    err_s1, _ = _max_logit_diff(cnn, to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0, stride_mode="s1"), x)
    err_paper, _ = _max_logit_diff(cnn, to_tcnn(cnn), x)  # alpha = lambda = 1 ([TCNN21] Sec. 2)
    assert err_exact <= 1e-4 < 1e-2 < min(err_s1, err_paper)


def test_stage_selection_and_errors() -> None:
    cnn = timm.create_model("resnet10_cifar", num_classes=10, in_chans=1)
    t = to_tcnn(cnn, stages=(-2, -1))
    names = [n for n, _ in gpsa_modules(t)]
    assert names == ["layer3.0.conv1", "layer3.0.conv2", "layer4.0.conv1", "layer4.0.conv2"]
    assert [n for n, _ in model_stages(cnn)] == ["layer1", "layer2", "layer3", "layer4"]
    assert isinstance(t.get_submodule("layer3.0.conv1"), GPSA)
    with pytest.raises(ValueError, match="out of range"):
        to_tcnn(cnn, stages=(4,))
    with pytest.raises(ValueError, match="stride_mode"):
        to_tcnn(cnn, stride_mode="botnet")
    with pytest.raises(ValueError, match="no ResNet stages"):
        to_tcnn(nn.Sequential(nn.Conv2d(3, 3, 3, padding=1)))
    with torch.device("meta"):
        rx = timm.create_model("resnext50_32x4d", num_classes=10)
    with pytest.raises(ValueError, match=r"layer4\.0\.conv2.*grouped"):
        to_tcnn(rx)


def test_tcnn_trains_and_keeps_bn() -> None:
    torch.manual_seed(2)
    cnn = timm.create_model("resnet10_cifar", num_classes=10, in_chans=1, zero_init_last=False)
    t = to_tcnn(cnn)
    assert isinstance(t.layer4[0].bn1, nn.BatchNorm2d)
    opt = torch.optim.SGD(t.parameters(), lr=0.1)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    loss = nn.functional.cross_entropy(t(x), y)
    loss.backward()
    for name in ("layer4.0.conv1", "layer4.0.conv2"):
        g = t.get_submodule(name)
        assert g.pos_alpha.grad is not None and g.gating_param.grad.abs().max() > 0, name
    opt.step()


RS_TABLE2 = {  # [TCNN21] Table 2: ResNet-RS params (M) and T-ResNet-RS params (M)
    "resnetrs50": (36, 38),
    "resnetrs101": (64, 66),
    "resnetrs152": (87, 89),
    "resnetrs200": (93, 96),
    "resnetrs270": (130, 133),
    "resnetrs350": (164, 167),
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(RS_TABLE2))
def test_parameter_counts_match_paper_table2(arch: str) -> None:
    with torch.device("meta"):  # no memory, no init compute
        cnn = timm.create_model(arch, num_classes=1000)
    tcnn = to_tcnn(cnn)
    n_cnn = sum(p.numel() for p in cnn.parameters())
    n_tcnn = sum(p.numel() for p in tcnn.parameters())
    assert (round(n_cnn / 1e6), round(n_tcnn / 1e6)) == RS_TABLE2[arch]
    # [TCNN21] Sec. 2: three D_in x D_in matrices per converted conv (plus 4 positional numbers per head)
    extra = 0
    for _, g in gpsa_modules(tcnn):
        extra += g.qkv_weight.numel() + g.pos_alpha.numel() + g.pos_center.numel() + g.gating_param.numel()
        assert abs(g.qkv_weight.numel() - 3 * g.in_dim**2) <= 2 * g.in_dim * g.num_heads
    assert n_tcnn - n_cnn == extra


def test_state_dict_round_trip_through_build() -> None:
    from core.models.factory import build

    torch.manual_seed(3)
    a = build("tcnn", "resnet10_cifar", 10, in_chans=1, alpha_init=2.0, lambda_init=0.5).eval()
    sd = a.state_dict()
    assert {"layer4.0.conv2.weight", "layer4.0.conv2.qkv_weight", "layer4.0.conv2.pos_alpha"} <= set(sd)
    b = build("tcnn", "resnet10_cifar", 10, in_chans=1).eval()  # different init
    b.load_state_dict(sd)
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_attention_switch_keeps_the_gpsa_default() -> None:
    """to_attention(Conversion(attention="psa")) == to_tcnn(attention="psa"): PSA layers at the same paths and
    the same function; the default stays GPSA; a Conversion's switches act on the converted layers."""
    from core.models.kinds import Conversion
    from core.nn.psa import PSA
    from core.reparam import to_attention

    cnn = timm.create_model("resnet10_cifar", num_classes=10, in_chans=1).eval()
    a = to_tcnn(cnn, attention="psa", alpha_init=2.0).eval()
    b = to_attention(cnn, Conversion(attention="psa", alpha_init=2.0)).eval()
    assert [type(m) for _, m in gpsa_modules(a)] == [PSA, PSA]
    assert (
        [n for n, _ in gpsa_modules(a)]
        == [n for n, _ in gpsa_modules(b)]
        == ["layer4.0.conv1", "layer4.0.conv2"]
    )
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert all(isinstance(m, GPSA) for _, m in gpsa_modules(to_tcnn(cnn)))
    assert set(a.state_dict()) == set(b.state_dict())
    frozen = to_attention(cnn, Conversion(gating="freeze0"))
    gates = [m.gating_param for _, m in gpsa_modules(frozen)]
    assert gates and all(not g.requires_grad and float(g.abs().max()) == 0.0 for g in gates)
    with pytest.raises(ValueError, match="attention must be one of"):
        to_tcnn(cnn, attention="sa")


def test_agreement_of_logits() -> None:
    """core.analysis.equivalence.agreement against hand-computed values."""
    from core.analysis.equivalence import agreement

    ref = torch.tensor([[1.0, 2.0, 0.0], [3.0, -1.0, 0.5]])
    other = torch.tensor([[1.5, 2.5, 0.0], [3.0, -1.0, 4.0]])  # row 0 still predicts class 1, row 1 flips
    got = agreement(ref, other)
    assert got["max_abs_logit_diff"] == pytest.approx(3.5)
    assert got["mean_abs_logit_diff"] == pytest.approx(4.5 / 6)  # (0.5 + 0.5 + 3.5) / 6
    assert got["max_abs_logit_cnn"] == pytest.approx(3.0) and got["prediction_agreement"] == pytest.approx(
        0.5
    )
    assert agreement(torch.zeros(0, 3), torch.zeros(0, 3))["prediction_agreement"] is None
    with pytest.raises(ValueError):
        agreement(ref, other[:1])
