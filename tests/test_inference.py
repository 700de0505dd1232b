"""core.training.inference: every inference form equals the eager model (and, for the T-CNN at large alpha and
lambda, the CNN it was converted from), the fastest qualifying form is picked, and untraceable models fall back."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

from core.models.conversion import to_tcnn
from core.models.factory import build
from core.models.he_cifar import resnet20
from core.nn.gated_mix import gated_mix
from core.nn.gpsa_tcnn import TcnnGPSA
from core.training import inference as inf

TOL = 1e-4


def _net(arch: str) -> nn.Module:
    torch.manual_seed(0)
    cnn = resnet20() if arch == "resnet20" else build("cnn", arch, 10)
    with torch.no_grad():  # non-trivial batch-norm statistics, so that folding them is exercised
        for m in cnn.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    return cnn.eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max().item() <= TOL
    assert torch.equal(a.argmax(1), b.argmax(1))


@pytest.mark.parametrize("arch", ["resnet12_cifar_os16", "resnet20"])
@pytest.mark.parametrize("alpha", [1.0, 50.0])
def test_tcnn_forms_equal_eager_and_cnn(arch: str, alpha: float) -> None:
    """Traced (GPSA included) and sub-batched forms give the eager T-CNN's logits, on batch sizes that do and do
    not divide the sub-batch; at alpha = lambda = 50 also the original CNN's ([TCNN21] Sec. 2: the conv)."""
    cnn = _net(arch)
    tcnn = to_tcnn(cnn, alpha_init=alpha, lambda_init=alpha).eval()
    assert any(isinstance(m, TcnnGPSA) for m in tcnn.modules())
    torch.manual_seed(1)
    x = torch.randn(70, 3, 32, 32)
    forms = dict(inf._candidates(tcnn, x))  # sub-batches of 64 (smaller than the example) included
    assert "TorchScript (traced, frozen), channels-last, in batches of 64" in forms
    traced = forms["TorchScript (traced, frozen), channels-last"]
    assert "prim::PythonOp" not in str(traced.fast.graph)  # the gated mix runs as aten ops
    with torch.no_grad():
        eager = tcnn(x)
        for form in forms.values():
            _close(form(x), eager)  # 70 images: sub-batches of 64 + 6
            _close(form(x[:5]), tcnn(x[:5]))
        if alpha == 50.0:
            _close(traced(x), cnn(x))


def test_traced_gpsa_holds_the_positional_attention_as_a_constant() -> None:
    """Input-independent terms come from the layer's cache: the traced graph computes one softmax (content)."""
    torch.manual_seed(0)
    g = TcnnGPSA.from_conv(nn.Conv2d(16, 16, 3, padding=1)).eval()
    x = torch.randn(4, 16, 8, 8)
    traced = inf._trace(g, x)
    assert str(traced.graph).count("aten::softmax") == 1
    z = torch.randn(3, 16, 8, 8)
    with torch.no_grad():
        assert (traced(z) - g(z)).abs().max().item() <= 1e-5


def test_gated_mix_without_autograd_is_the_same_computation() -> None:
    torch.manual_seed(0)
    con = torch.rand(2, 9, 16, 16)
    pos, g = torch.rand(9, 16, 16), torch.rand(9, 1, 1)
    with_grad = gated_mix(con.requires_grad_(), pos, g, (0, 2, 1, 3), probs=True)
    with torch.no_grad():
        plain = gated_mix(con, pos, g, (0, 2, 1, 3), probs=True)
    assert torch.equal(with_grad.detach(), plain) and plain.stride() == with_grad.stride()


def test_inference_model_picks_the_fastest_matching_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timing decides among matching forms; a faster form with other logits (on the example or on a batch of
    another size), or one that fails, never wins."""
    model = _net("resnet12_cifar_os16")
    x = torch.randn(6, 3, 32, 32)

    def slow(m: nn.Module) -> object:
        def f(z: torch.Tensor) -> torch.Tensor:
            # 0.5 s: far above a loaded machine's jitter on the 6-image call (it beat 0.05 s once)
            time.sleep(0.5)
            return m(z)

        return f

    def broken(z: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no")

    def batch_bound(z: torch.Tensor) -> torch.Tensor:  # right on the example's batch size only
        return model(z) if len(z) == len(x) else model(z) + 1.0

    fake = [("eager", slow(model)), ("wrong", lambda z: model(z) + 1.0), ("broken", broken),
            ("batch-bound", batch_bound), ("fast", model)]  # fmt: skip
    monkeypatch.setattr(inf, "_candidates", lambda m, e: fake)
    form, kind = inf.inference_model(model, x)
    assert kind == "fast" and form is model


def test_inference_model_picks_a_traced_tcnn_form_when_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPSA models are no longer excluded: the real traced T-CNN forms qualify (equal to eager within tol) and
    one is picked when the eager forms are slower (made slower here, so that timing noise cannot decide)."""
    tcnn = to_tcnn(_net("resnet12_cifar_os16")).eval()
    x = torch.randn(40, 3, 32, 32)
    real = inf._candidates

    def eager_slowed(m: nn.Module, e: torch.Tensor) -> list:
        def slow(f: object) -> object:
            return lambda z: (time.sleep(0.5), f(z))[1]

        return [(n, f if "TorchScript" in n else slow(f)) for n, f in real(m, e)]

    monkeypatch.setattr(inf, "_candidates", eager_slowed)
    form, kind = inf.inference_model(tcnn, x)
    assert kind.startswith("TorchScript (traced, frozen), channels-last")
    with torch.no_grad():
        _close(form(x), tcnn(x))


class _Untraceable(nn.Module):
    """A model that cannot be traced (stands in for Python-side control flow that tracing refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_tracing():
            raise RuntimeError("data-dependent Python branch")
        return self.net(x)


def test_untraceable_model_falls_back_to_eager_forms() -> None:
    torch.manual_seed(0)
    model = _Untraceable().eval()
    x = torch.randn(70, 3, 16, 16)
    names = [n for n, _ in inf._candidates(model, x)]
    assert not any("TorchScript" in n for n in names)
    assert "eager, channels-last, in batches of 64" in names
    form, kind = inf.inference_model(model, x)
    assert "TorchScript" not in kind
    with torch.no_grad():
        _close(form(x), model(x))


def test_other_image_size_runs_eagerly() -> None:
    """A traced form is used for the example's image shape only; another size gets the eager result."""
    tcnn = to_tcnn(_net("resnet12_cifar_os16")).eval()
    forms = dict(inf._candidates(tcnn, torch.randn(8, 3, 32, 32)))
    z = torch.randn(3, 3, 40, 40)
    with torch.no_grad():
        for form in forms.values():
            _close(form(z), tcnn(z))
