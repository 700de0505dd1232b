"""The `precision` setting (core.training.precision) on CPU, where torch's autocast supports bf16 and fp16:
every model kind trains and evaluates under bf16; the T-CNN right after reparameterization stays as close to
its CNN as bf16 rounding allows; a run checkpointed under autocast resumes bitwise; fp16 gets a loss scaler.

Truths: the same computation in fp32 (bf16's error is measured against it), the uninterrupted run (resume).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from core.analysis.equivalence import LARGE_INIT, PAPER_INIT
from core.config import AugmentConfig, validate_params
from core.data import BatchLoader
from core.models import kinds
from core.models.factory import build
from core.reparam import to_tcnn
from core.training.checkpoint import load
from core.training.loop import TIMING_KEYS, fit
from core.training.model_eval import TrainLoss, evaluate
from core.training.optim import WarmupCosine, build_sgd
from core.training.precision import PRECISIONS, autocast, grad_scaler, resolve
from core.training.resume_file import RESUME_FILE
from core.training.stop_signals import Preempted

CPU = torch.device("cpu")
ARCH = {"convit": "convit_fmnist", "cmhsa": "cmhsa_fmnist"}
#: bf16 keeps 8 significant bits: unit roundoff u = 2**-8 (fp32: 2**-24).
BF16_U = 2.0**-8


def _loaders(n: int = 48, seed: int = 0) -> tuple[BatchLoader, BatchLoader]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, size=(n + 16, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, size=n + 16)
    kw = {"seed": 3, "mean": [0.3], "std": [0.35], "num_classes": 10}
    aug = AugmentConfig(crop_padding=2, hflip=True)
    return (
        BatchLoader(x[:n], y[:n], batch_size=16, train=True, augment=aug, **kw),
        BatchLoader(x[n:], y[n:], batch_size=16, train=False, **kw),
    )


def _fit(model: nn.Module, work: Path, precision: str, *, epochs: int = 1, on_step=None, every: int = 0):
    train, val = _loaders()
    torch.manual_seed(123)
    opt = build_sgd(model, lr=0.05, momentum=0.9, weight_decay=1e-4)
    sched = WarmupCosine(opt, total_steps=epochs * len(train), warmup_steps=1)
    res = fit(
        model, opt, sched, train, epochs=range(epochs), work_dir=work, run_hash=f"p-{precision}",
        loss_fn=TrainLoss(0.0), val_loader=val, device=CPU, precision=precision,
        checkpoint_every_steps=every, on_step=on_step, log=lambda m: None,
    )  # fmt: skip
    return opt, res


def test_the_setting_is_one_list_and_resolves_per_device() -> None:
    assert validate_params({}).precision == "auto"
    assert validate_params({"precision": "bf16"}).precision == "bf16"
    with pytest.raises(Exception, match="precision"):
        validate_params({"precision": "fp8"})
    assert resolve("auto", CPU) == "fp32" and resolve("auto", torch.device("cuda")) == "bf16"
    assert {resolve(p, CPU) for p in PRECISIONS} == {"fp32", "bf16", "fp16"}
    x = torch.randn(4, 8)
    lin = nn.Linear(8, 3)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(CPU, precision):
            assert lin(x).dtype == dtype, precision
    assert grad_scaler(CPU, "fp16").is_enabled() and not grad_scaler(CPU, "bf16").is_enabled()


@pytest.mark.slow
@pytest.mark.parametrize("kind", kinds.kind_names())
def test_every_kind_trains_and_evaluates_under_bf16(kind: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build(kind, ARCH.get(kind, "resnet10_cifar"), 10, in_chans=1, **(
        {"img_size": 28} if kind == "convit" else {}))  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[torch.dtype] = []
    head = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
    hook = head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    _, res = _fit(model, tmp_path, "bf16")
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}  # the forward really ran under bf16 autocast
    row = res.history[-1]
    assert np.isfinite(row["train_loss"]) and np.isfinite(row["val_loss"]) and 0.0 <= row["val_acc"] <= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # it trained
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    got = evaluate(model, _loaders()[1].batches(0), device=CPU, precision="bf16")
    assert got["n"] == 16 and np.isfinite(got["loss"]) and 0.0 <= got["acc"] <= 1.0


def _trained_like_cnn(seed: int) -> nn.Module:
    """The default CNN with BatchNorm affine parameters drawn as after training (timm zero-inits each block's
    last BN, which would leave the converted layers without any effect on the logits)."""
    torch.manual_seed(seed)
    cnn = build("cnn", "resnet10_cifar_os16", 10, in_chans=1).eval()
    for m in cnn.modules():
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.normal_(m.bias, 0.0, 0.1)
    return cnn


@pytest.mark.parametrize("seed", [0, 1])
def test_tcnn_after_reparameterization_is_within_bf16_rounding_of_its_cnn(seed: int) -> None:
    """Under bf16 each network is off its own fp32 logits by rounding alone: of order u * max|logit| per
    operation (u = 2**-8), accumulated over the depth. Bound: the T-CNN's bf16 error is at most 4x the CNN's
    own bf16 error plus u * max|logit|, i.e. the GPSA layers (softmaxes, positional cache, gates) add no more
    than bf16 rounding of the same size. At the large init the reference is the CNN's fp32 function (the
    T-CNN computes it to fp32 precision, DESIGN section 4); at the paper's init, where the functions differ
    by design, it is the T-CNN's own fp32 function. Measured: CNN bf16 error about 5e-3 on logits of
    about 0.8, the T-CNN's the same to within 20%."""
    cnn = _trained_like_cnn(seed)
    x = torch.randn(32, 1, 28, 28)
    with torch.no_grad():
        ref = cnn(x)
        with autocast(CPU, "bf16"):
            cnn_err = (cnn(x).float() - ref).abs().max()
        assert cnn_err > 0  # bf16 really rounded
        for alpha, lam in (LARGE_INIT, PAPER_INIT):
            tcnn = to_tcnn(cnn, alpha_init=alpha, lambda_init=lam).eval()
            own = tcnn(x)
            if (alpha, lam) == LARGE_INIT:
                assert (own - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32: the same function
            else:
                assert (own - ref).abs().max() > 10 * cnn_err  # the paper's init changes the function
            with autocast(CPU, "bf16"):
                err = (tcnn(x).float() - own).abs().max()
            bound = 4 * cnn_err + BF16_U * own.abs().max()
            assert err <= bound, (alpha, float(err), float(cnn_err), float(bound))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_run_checkpointed_under_autocast_resumes_bitwise(tmp_path: Path, precision: str) -> None:
    torch.manual_seed(0)
    ref_model = build("tcnn", "resnet10_cifar", 10, in_chans=1)
    init = {k: v.clone() for k, v in ref_model.state_dict().items()}
    _, ref = _fit(ref_model, tmp_path / "ref", precision, epochs=2, every=2)

    def stop_at(info) -> None:
        if info.global_step == 4:
            info.stop.received = 15

    model = build("tcnn", "resnet10_cifar", 10, in_chans=1)
    model.load_state_dict(init)
    with pytest.raises(Preempted):
        _fit(model, tmp_path / "cut", precision, epochs=2, on_step=stop_at, every=2)
    state = load(tmp_path / "cut" / RESUME_FILE)
    assert state["global_step"] == 4
    assert (
        state["scaler"].get("scale", None) is not None or precision == "bf16"
    )  # fp16: the loss scale is kept
    resumed = build("tcnn", "resnet10_cifar", 10, in_chans=1)  # another init: all from the checkpoint
    _, res = _fit(resumed, tmp_path / "cut", precision, epochs=2, every=2)
    assert res.resumed_from is not None
    for k, v in ref_model.state_dict().items():
        assert torch.equal(v, resumed.state_dict()[k]), k

    def strip(h):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in h]

    assert strip(res.history) == strip(ref.history)
