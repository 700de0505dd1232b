"""core.viz.report_plots: the data behind the Fig. 4 / Fig. 5 plots, checked against independent truths."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from core.analysis.dissect import centre_query_maps as centre_query_attention
from core.models.factory import build
from core.reparam import gpsa_modules, to_tcnn
from core.viz.report_plots import (
    gpsa_dynamics,
    plot_attention_maps,
    plot_gpsa_dynamics,
    plot_training_curves,
    preprocess_image,
)


def _cnn(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build("cnn", "resnet10_cifar", 10, in_chans=1).eval()


def _image(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    img = rng.integers(0, 60, size=(28, 28, 1)).astype(np.uint8)
    img[8:20, 10:18] = 220  # an object in the middle
    return img


def _png_ok(data: bytes, min_w: int = 400, min_h: int = 150) -> Image.Image:
    im = Image.open(io.BytesIO(data))
    im.load()
    assert im.format == "PNG" and im.width >= min_w and im.height >= min_h
    px = np.asarray(im.convert("L"), dtype=np.float64)
    assert px.std() > 5  # not a blank canvas
    return im


def _perturbed_tcnn(seed: int = 1) -> torch.nn.Module:
    """A T-CNN as after fine-tuning: gates spread over (0, 1), spans and centres moved."""
    tcnn = to_tcnn(_cnn(), alpha_init=1.0, lambda_init=1.0).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in gpsa_modules(tcnn):
            m.gating_param.copy_(torch.linspace(-4, 4, m.num_heads)[torch.randperm(m.num_heads, generator=g)])
            m.pos_alpha.add_(torch.rand(m.num_heads, generator=g) * 2 - 1)
            m.pos_center.add_(torch.rand(m.num_heads, 2, generator=g) * 0.6 - 0.3)
            m.qkv_weight.mul_(20.0)  # sharper content attention than the 0.02-std init
    return tcnn


# ------------------------------------------------------------------------------------------------ Fig. 5
def test_centre_query_maps_are_the_taps_at_large_alpha_and_lambda() -> None:
    """At alpha = lambda = 50 (function-preserving init, [TCNN21] Sec. 2) head h attends to its tap: the key at
    query + (h // 3 - 1, h % 3 - 1). Tap geometry from the conv's definition, not from the module."""
    tcnn = to_tcnn(_cnn(), alpha_init=50.0, lambda_init=50.0).eval()
    x = preprocess_image(_image(), [0.3], [0.3])
    layers, logits = centre_query_attention(tcnn, x)
    assert [la.name for la in layers] == ["layer4.0.conv1", "layer4.0.conv2"]
    assert logits.shape == (1, 10)
    # the input grids of the last stage on a 28 px image: 7x7 (stride-2 conv1), then 4x4
    assert [la.grid for la in layers] == [(7, 7), (4, 4)]
    assert [la.stride for la in layers] == [2, 1]
    # the centre query: nearest (h - 1) / 2 among the query positions 0, s, 2s, ... (ties -> the lower)
    assert layers[0].query == (2, 2) and layers[1].query == (1, 1)
    for la in layers:
        assert la.maps.shape == (9, *la.grid)
        np.testing.assert_allclose(la.maps.sum(axis=(1, 2)), 1.0, atol=1e-6)
        assert (la.maps >= 0).all()
        for h in range(9):
            r, c = la.query[0] + h // 3 - 1, la.query[1] + h % 3 - 1
            assert la.maps[h, r, c] > 0.99, (la.name, h, la.maps[h].round(3))
        np.testing.assert_allclose(la.gate, 1 / (1 + math.exp(-50.0)), rtol=1e-6)
        np.testing.assert_allclose(la.inv_alpha, 1 / 50.0, rtol=1e-4)


def _manual_attention(m, inp: torch.Tensor, query: tuple[int, int]) -> np.ndarray:
    """[TCNN21] Eq. 7 written out for one query: (1 - s(l)) softmax_j(q.k / sqrt(d)) + s(l) softmax_j(-a |d - D|^2),
    the positional softmax over the zero-padded key grid (padded keys take mass, as a conv's zero padding)."""
    _, c, h, w = inp.shape
    nh, dq, p = m.num_heads, m.qk_head_dim, m.padding
    tokens = inp[0].permute(1, 2, 0).reshape(h * w, c).double()
    wqkv = m.qkv_weight.detach().double()
    q = tokens[query[0] * w + query[1]] @ wqkv[: nh * dq].T
    k = tokens @ wqkv[nh * dq : 2 * nh * dq].T
    q, k = q.view(nh, dq), k.view(h * w, nh, dq)
    content = torch.softmax(torch.einsum("hd,jhd->hj", q, k) / math.sqrt(dq), dim=-1).view(nh, h, w)
    rows = torch.arange(-p, h + p, dtype=torch.float64)[:, None] - query[0]
    cols = torch.arange(-p, w + p, dtype=torch.float64)[None, :] - query[1]
    alpha = torch.nn.functional.softplus(m.pos_alpha.detach().double(), beta=5.0) + 1e-6
    ctr = m.pos_center.detach().double()
    score = -alpha[:, None, None] * (
        (rows - ctr[:, 0, None, None]) ** 2 + (cols - ctr[:, 1, None, None]) ** 2
    )
    pos = torch.softmax(score.reshape(nh, -1), dim=-1).view(nh, h + 2 * p, w + 2 * p)[:, p : p + h, p : p + w]
    g = torch.sigmoid(m.gating_param.detach().double())[:, None, None]
    return ((1 - g) * content + g * pos).numpy()


def test_centre_query_maps_match_eq7_written_out() -> None:
    tcnn = _perturbed_tcnn().double()  # float64 end to end: compare at 1e-9, not at float32 rounding
    x = preprocess_image(_image(3), [0.3], [0.3]).double()
    captured = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, n=n: captured.__setitem__(n, a[0].detach()))
        for n, m in gpsa_modules(tcnn)
    ]
    with torch.no_grad():
        tcnn(x)
    for hk in hooks:
        hk.remove()
    layers, _ = centre_query_attention(tcnn, x)
    mods = dict(gpsa_modules(tcnn))
    for la in layers:
        want = _manual_attention(mods[la.name], captured[la.name], la.query)
        np.testing.assert_allclose(la.maps, want, rtol=0, atol=1e-9)
        # over the real keys a head's map sums to 1 minus the positional mass on the zero padding: in (1 - g, 1]
        sums, g = la.maps.sum(axis=(1, 2)), la.gate
        assert (sums <= 1 + 1e-9).all() and (sums > 1 - g - 1e-9).all()
        np.testing.assert_allclose(
            la.gate, torch.sigmoid(mods[la.name].gating_param).detach().numpy(), rtol=1e-6
        )
    assert len({round(float(g), 3) for g in layers[0].gate}) == 9  # the perturbation took


def test_centre_query_maps_sum_to_one_with_content_attention() -> None:
    """Gates spread over (0, 1) (content attention mixed in), alpha large and centres on the taps: no mass
    reaches the padding from the centre query, so each head's map over the keys sums to 1."""
    tcnn = _perturbed_tcnn()
    with torch.no_grad():
        for _, m in gpsa_modules(tcnn):
            m.set_positional(alpha=torch.full((9,), 50.0), centers=m.tap_offsets())
    layers, _ = centre_query_attention(tcnn, preprocess_image(_image(4), [0.3], [0.3]))
    for la in layers:
        assert la.gate.min() < 0.05 and la.gate.max() > 0.95
        np.testing.assert_allclose(la.maps.sum(axis=(1, 2)), 1.0, atol=1e-6)
        content_heads = la.gate < 0.5
        assert (la.maps[content_heads].reshape(int(content_heads.sum()), -1).max(axis=1) < 0.99).all()


def test_centre_query_attention_rejects_a_batch() -> None:
    with pytest.raises(ValueError, match="one image"):
        centre_query_attention(_perturbed_tcnn(), torch.zeros(2, 1, 28, 28))


def test_preprocess_matches_the_evaluation_transform() -> None:
    img = _image(5)
    x = preprocess_image(img, [0.25], [0.5])
    np.testing.assert_allclose(x[0, 0].numpy(), (img[..., 0] / 255.0 - 0.25) / 0.5, rtol=1e-6)
    assert preprocess_image(img, [0.25], [0.5], 32).shape == (1, 1, 32, 32)


def test_plot_attention_maps_png() -> None:
    layers, _ = centre_query_attention(_perturbed_tcnn(), preprocess_image(_image(), [0.3], [0.3]))
    _png_ok(plot_attention_maps(layers, _image()), min_w=1000, min_h=300)
    with pytest.raises(ValueError, match="no GPSA"):
        plot_attention_maps([], _image())


# ------------------------------------------------------------------------------------------------ Fig. 4
def _rows(epochs=(3, 4, 5), heads=9) -> list[dict]:
    rows = []
    for e in epochs:
        for layer in ("layer4.0.conv1", "layer4.0.conv2"):
            for h in range(heads):
                rows.append(
                    {"epoch": str(e), "layer": layer, "head": str(h), "inv_alpha": str(1 + 0.1 * h * (e - 3)),
                     "gate": str(0.73 - 0.05 * h * (e - 3) / 2), "nonlocality": str(1.0 + 0.01 * e)}
                )  # fmt: skip
    return rows


def test_gpsa_dynamics_layout() -> None:
    dyn = gpsa_dynamics(_rows())
    np.testing.assert_array_equal(dyn.epochs, [0, 1, 2])  # relative to the first row ("continue": t1 ..)
    assert list(dyn.values) == ["layer4.0.conv1", "layer4.0.conv2"]
    v = dyn.values["layer4.0.conv2"]
    assert v["inv_alpha"].shape == (3, 9)
    assert v["inv_alpha"][2, 4] == pytest.approx(1 + 0.1 * 4 * 2)
    assert v["gate"][1, 8] == pytest.approx(0.73 - 0.05 * 8 / 2)
    _png_ok(plot_gpsa_dynamics(dyn), min_w=600, min_h=500)


def test_gpsa_dynamics_without_nonlocality_and_bad_rows() -> None:
    rows = [{k: v for k, v in r.items() if k != "nonlocality"} for r in _rows(epochs=(0,))]
    dyn = gpsa_dynamics(rows)
    assert set(dyn.values["layer4.0.conv1"]) == {"inv_alpha", "gate"}
    _png_ok(plot_gpsa_dynamics(dyn), min_w=500, min_h=300)
    with pytest.raises(ValueError, match="no rows"):
        gpsa_dynamics([])
    with pytest.raises(ValueError, match="lacks"):
        gpsa_dynamics([{"layer": "x", "head": 0}])


# ------------------------------------------------------------------------------------------------ curves
def test_training_curves_png(tmp_path) -> None:
    pre = [{"epoch": e, "lr": 0.1, "train_loss": 2 / e, "train_acc": 0.5 + e / 20, "val_loss": 2.1 / e,
            "val_acc": 0.5 + e / 21} for e in range(1, 5)]  # fmt: skip
    ft = [{"epoch": 0, "finetune_epoch": 0, "val_loss": 0.6, "val_acc": 0.7}] + [
        {"epoch": e, "finetune_epoch": e, "lr": 1e-5, "train_loss": 0.5, "train_acc": 0.8, "val_loss": 0.5,
         "val_acc": 0.8} for e in (1, 2)
    ]  # fmt: skip
    path = tmp_path / "plots" / "curves.png"
    data = plot_training_curves(pre, ft, path, reparam_epoch=4)
    assert path.read_bytes() == data
    _png_ok(data, min_w=1000, min_h=300)
    _png_ok(plot_training_curves(None, ft, reparam_epoch=4), min_w=1000, min_h=300)
    with pytest.raises(ValueError, match="no history"):
        plot_training_curves(None, [])
