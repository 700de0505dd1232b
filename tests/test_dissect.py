"""Dissection views (core.analysis.dissect): centre-query maps, mass contours, nonlocality on real layer inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from core.analysis.dissect import centre_query_maps, dynamics_table, layer_stats, long_rows, mass_contours
from core.nn.gpsa_tcnn import TcnnGPSA
from core.nn.locality import grid_distances, nonlocality
from core.nn.psa import PSA
from core.viz.report_plots import plot_attention_contours, plot_nonlocality, to_png


def _gpsa_net(stride: int = 1) -> nn.Sequential:
    torch.manual_seed(0)
    pre = nn.Conv2d(1, 4, 1)
    g = TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, stride=stride, padding=1), alpha_init=50.0, lambda_init=50.0)
    return nn.Sequential(pre, g)


def test_centre_query_of_a_local_gpsa_peaks_on_its_kernel_tap() -> None:
    """[TCNN21] Fig. 5 at large alpha: head h of the centre query (3, 3) of a 7 x 7 map looks at the tap
    (3 + h // 3 - 1, 3 + h % 3 - 1) (row-major taps), with all its mass there."""
    layers, logits = centre_query_maps(_gpsa_net(), torch.randn(1, 1, 7, 7))
    (la,) = layers
    assert la.name == "1" and la.grid == (7, 7) and la.query == (3, 3) and la.maps.shape == (9, 7, 7)
    for h in range(9):
        r, c = np.unravel_index(la.maps[h].argmax(), (7, 7))
        assert (r, c) == (3 + h // 3 - 1, 3 + h % 3 - 1)
        assert la.maps[h, r, c] > 1 - 1e-6
    np.testing.assert_allclose(la.inv_alpha, 1 / 50, rtol=1e-5)
    assert logits.shape == (1, 4, 7, 7)


def test_centre_query_with_stride_two_and_even_grid() -> None:
    """Stride 2 on an 8 x 8 map: queries at rows/cols 0, 2, 4, 6; nearest the centre 3.5 is 4, so the
    query is (4, 4) and the centre head (tap (1, 1)) peaks on it, the top-left head one pixel up-left."""
    layers, _ = centre_query_maps(_gpsa_net(stride=2), torch.randn(1, 1, 8, 8))
    (la,) = layers
    assert la.stride == 2 and la.query == (4, 4)
    assert np.unravel_index(la.maps[4].argmax(), (8, 8)) == (4, 4)
    assert np.unravel_index(la.maps[0].argmax(), (8, 8)) == (3, 3)


def test_mass_contours_on_a_hand_made_map() -> None:
    a = np.array([[0.05, 0.40], [0.30, 0.25]])  # sorted: 0.40, 0.30, 0.25, 0.05 (sum 1)
    c90, c50, c10 = mass_contours(a)
    # 90%: 0.40 + 0.30 + 0.25 = 0.95 is the first cumulative sum >= 0.9 -> three keys, threshold 0.25
    assert (c90.area, c90.threshold, c90.mass) == (3, 0.25, pytest.approx(0.95))
    assert c90.mask.tolist() == [[False, True], [True, True]]
    # 50%: 0.40 + 0.30 = 0.70 -> two keys; 10%: the peak alone (0.40)
    assert (c50.area, c50.threshold, c50.mass) == (2, 0.30, pytest.approx(0.70))
    assert (c10.area, c10.threshold, c10.mass) == (1, 0.40, pytest.approx(0.40))
    # unnormalised maps (border rows of a padded attention) are measured relative to their own mass
    (half,) = mass_contours(3 * a, levels=(0.5,))
    assert half.area == 2
    # ties at the threshold are all in (a contour cannot split equal values)
    (t,) = mass_contours(np.array([[0.25, 0.25], [0.25, 0.25]]), levels=(0.3,))
    assert t.area == 4 and t.mass == pytest.approx(1.0)
    with pytest.raises(ValueError, match="non-negative"):
        mass_contours(np.array([[-1.0, 2.0]]))


def test_nonlocality_matches_a_hand_computation_of_eq8() -> None:
    """[ConViT21] Eq. 8 on a 2 x 2 grid, one head: D = (1/L) sum_ij A_ij |delta_ij|."""
    dist = grid_distances(2, 2)
    s2 = math.sqrt(2)
    want = [[0, 1, 1, s2], [1, 0, s2, 1], [1, s2, 0, 1], [s2, 1, 1, 0]]
    np.testing.assert_allclose(dist.numpy(), np.array(want), rtol=1e-12)
    uniform = torch.full((1, 4, 4), 0.25)  # every query: 0.25 (0 + 1 + 1 + sqrt 2)
    assert nonlocality(uniform, dist).item() == pytest.approx((2 + s2) / 4)
    a = torch.tensor([[[1.0, 0, 0, 0], [0, 0, 0, 1], [0.5, 0.5, 0, 0], [0, 0, 0, 1]]])
    # query 0: 0; query 1 -> key 3: 1; query 2: 0.5 * 1 + 0.5 * sqrt 2; query 3: 0  -> mean over 4 queries
    assert nonlocality(a, dist).item() == pytest.approx((1 + 0.5 + 0.5 * s2) / 4)
    # two heads, a batch of two: heads kept apart, batch averaged
    two = torch.stack([torch.cat([uniform, a]), torch.cat([a, uniform])])
    got = nonlocality(two, dist)
    expect = ((2 + s2) / 4 + (1 + 0.5 + 0.5 * s2) / 4) / 2
    assert got.tolist() == pytest.approx([expect, expect])
    # stride 2 on a 3 x 3 grid: queries (0, 0), (0, 2), (2, 0), (2, 2) -> distance to key (1, 1) is sqrt 2
    d3 = grid_distances(3, 3, 2)
    assert d3.shape == (4, 9) and d3[:, 4].tolist() == pytest.approx([s2] * 4)


def test_layer_stats_use_each_layers_real_input() -> None:
    """The nonlocality is computed on what the layer receives inside the network (a forward pre-hook), not
    on the network input: it equals TcnnGPSA.nonlocality(pre(x)) and differs from the value on another input."""
    torch.manual_seed(3)
    pre = nn.Conv2d(4, 4, 1)
    g = TcnnGPSA.from_conv(nn.Conv2d(4, 4, 3, padding=1), alpha_init=0.5, lambda_init=-3.0)  # mostly content
    with torch.no_grad():
        g.qkv_weight.normal_(0, 1.0)
        pre.weight.mul_(5)
    net = nn.Sequential(pre, g).eval()
    x = torch.randn(3, 4, 6, 5)
    stats = layer_stats(net, x)
    assert set(stats) == {"1"} and set(stats["1"]) == {"inv_alpha", "gate", "nonlocality"}
    want = g.nonlocality(pre(x).detach())
    assert stats["1"]["nonlocality"] == pytest.approx(want.tolist(), rel=1e-6)
    assert max(abs(a - b) for a, b in zip(stats["1"]["nonlocality"], g.nonlocality(x).tolist())) > 1e-3
    assert stats["1"]["gate"] == pytest.approx([torch.sigmoid(torch.tensor(-3.0)).item()] * 9, rel=1e-6)
    # the generic path (attention_maps + Eq. 8) agrees with the layer's own accessor
    attn = g.attention_maps(pre(x).detach())
    assert nonlocality(attn, grid_distances(6, 5)).tolist() == pytest.approx(want.tolist(), rel=1e-6)


def test_psa_rows_have_no_gate_and_tables_and_figures_build() -> None:
    torch.manual_seed(4)
    net = nn.Sequential(nn.Conv2d(1, 4, 1), PSA.from_conv(nn.Conv2d(4, 4, 3, padding=1), alpha_init=2.0))
    stats = layer_stats(net, torch.randn(2, 1, 5, 5))
    assert set(stats["1"]) == {"inv_alpha", "nonlocality"}
    history = [{"epoch": 0, "gpsa": stats}, {"epoch": 1, "gpsa": stats}]
    rows = long_rows(history)
    assert len(rows) == 2 * 9 and all(r["gate"] is None for r in rows)
    table = dynamics_table(rows)
    assert table.num_rows == 18 and table.column("gate").null_count == 18
    assert table.column("inv_alpha").to_pylist()[0] == pytest.approx(0.5, rel=1e-5)
    fig = plot_nonlocality(rows)
    assert len(fig.axes[0].lines) == 1
    layers, _ = centre_query_maps(net, torch.randn(1, 1, 5, 5))
    assert np.isnan(layers[0].gate).all() and layers[0].maps.shape == (9, 5, 5)
    fig = plot_attention_contours(layers)
    assert len(fig.axes) == 9
    assert to_png(fig).startswith(b"\x89PNG")


def test_convit_layers_are_dissected_on_their_token_grid() -> None:
    from core.models.factory import build

    torch.manual_seed(5)
    m = build("convit", "convit_fmnist", 10, in_chans=1)
    layers, logits = centre_query_maps(m, torch.randn(1, 1, 28, 28))
    assert [la.name for la in layers] == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert all(la.grid == (7, 7) and la.query == (3, 3) and la.maps.shape == (4, 7, 7) for la in layers)
    # the local init puts head h (2 x 2 kernel, centre (0.5, 0.5) offsets) near its tap: mass sums to 1
    assert all(np.allclose(la.maps.sum(axis=(1, 2)), 1.0, atol=1e-5) for la in layers)
    stats = layer_stats(m, torch.randn(4, 1, 28, 28))
    assert set(stats) == {la.name for la in layers} and all(
        len(s["nonlocality"]) == 4 for s in stats.values()
    )
    assert logits.shape == (1, 10)
