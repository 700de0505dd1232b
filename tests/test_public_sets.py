"""Readers of the public robustness sets, on tiny copies the tests build."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.robustness import public_sets as P
from core.robustness.evaluation import count_correct


def _jpeg(path: Path, value: int, size: int = 8) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size, size, 3), value, np.uint8)).save(path, quality=95)


def test_cifar_c_reader_slices_severities(tmp_path):
    n = 4  # images per severity
    images = np.zeros((5 * n, 32, 32, 3), np.uint8)
    for s in range(5):
        images[s * n : (s + 1) * n] = 10 * (s + 1)  # each severity block has its own value
    labels = np.tile(np.arange(n), 5).astype(np.uint8)
    np.save(tmp_path / "fog.npy", images)
    np.save(tmp_path / "labels.npy", labels)
    assert P.cifar_c_corruptions(tmp_path) == ["fog"]
    for s in range(1, 6):
        x, y = P.read_cifar_c(tmp_path, "fog", s)
        assert x.shape == (n, 32, 32, 3) and (x == 10 * s).all()
        assert y.dtype == np.int64 and y.tolist() == list(range(n))
    x, y = P.read_cifar_c(tmp_path, "fog", None, mmap=False)
    assert len(x) == 5 * n and isinstance(x, np.ndarray)
    with pytest.raises(FileNotFoundError, match="snow.npy"):
        P.read_cifar_c(tmp_path, "snow", 1)
    np.save(tmp_path / "frost.npy", images[:7])  # not 5 x n
    with pytest.raises(ValueError, match="expected 5 x n"):
        P.read_cifar_c(tmp_path, "frost", 1)


def _imagenet_c_tree(root: Path, with_category: bool) -> None:
    wnids = ["n01440764", "n01443537", "n01484850"]
    for corruption, category in (("gaussian_noise", "noise"), ("fog", "weather")):
        base = root / category / corruption if with_category else root / corruption
        for s in (1, 2):
            for k, w in enumerate(wnids):
                for j in range(2):
                    _jpeg(base / str(s) / w / f"ILSVRC2012_val_{k}{j}.JPEG", 40 * k + 10 * s)


@pytest.mark.parametrize("with_category", [False, True])
def test_imagenet_c_reader_with_and_without_category_level(tmp_path, with_category):
    _imagenet_c_tree(tmp_path, with_category)
    sets = P.imagenet_c_sets(tmp_path)
    assert set(sets) == {(c, s) for c in ("gaussian_noise", "fog") for s in (1, 2)}
    ds = P.read_imagenet_c(tmp_path, "fog", 2)
    assert len(ds) == 6 and ds.classes == ["n01440764", "n01443537", "n01484850"]
    assert ds.labels.tolist() == [0, 0, 1, 1, 2, 2]
    img, label = ds[3]
    assert img.shape == (8, 8, 3) and img.dtype == np.uint8 and label == 1
    assert abs(int(img.mean()) - (40 * 1 + 20)) <= 2  # the pixels of that class and severity (JPEG)
    batches = list(ds.batches(4))
    assert [len(b[0]) for b in batches] == [4, 2] and batches[1][1].tolist() == [2, 2]
    with pytest.raises(FileNotFoundError, match="no fog/5"):
        P.read_imagenet_c(tmp_path, "fog", 5)


def test_imagenet_c_labels_follow_a_given_wnid_list(tmp_path):
    _imagenet_c_tree(tmp_path, False)
    full = ["n01234567", "n01440764", "n01443537", "n01484850"]  # the model's head has one class more
    ds = P.read_imagenet_c(tmp_path, "gaussian_noise", 1, wnids=full)
    assert ds.labels.tolist() == [1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="not in the class list"):
        P.read_imagenet_c(tmp_path, "gaussian_noise", 1, wnids=full[:2])


def test_tiny_imagenet_c_is_the_same_layout(tmp_path):
    for w in ("n02124075", "n04067472"):
        _jpeg(tmp_path / "zoom_blur" / "3" / w / "val_1.JPEG", 100, size=64)
    ds = P.read_tiny_imagenet_c(tmp_path, "zoom_blur", 3)
    assert len(ds) == 2 and ds[0][0].shape == (64, 64, 3)


def test_imagenet_a_and_r_subsets_map_onto_the_1000_class_head(tmp_path):
    full = [f"n{i:08d}" for i in range(1000, 2000)]  # a synthetic 1000-wnid list, index = head class
    (tmp_path / "synsets.txt").write_text("".join(f"{w} name {i}\n" for i, w in enumerate(full)))
    a_wnids, r_wnids = [full[i] for i in (6, 11, 900)], [full[i] for i in (1, 11, 999)]  # different subsets
    for name, wnids in (("a", a_wnids), ("r", r_wnids)):
        for k, w in enumerate(wnids):
            _jpeg(tmp_path / name / w / f"{k}.jpg", 50 * k, size=10 + k)  # mixed sizes
    ds_a, sub_a = P.read_imagenet_a(tmp_path / "a", tmp_path / "synsets.txt")
    ds_r, sub_r = P.read_imagenet_r(tmp_path / "r", full)
    assert sub_a.tolist() == [6, 11, 900] and sub_r.tolist() == [1, 11, 999]
    assert ds_a.labels.tolist() == [6, 11, 900] and ds_r.labels.tolist() == [1, 11, 999]
    with pytest.raises(ValueError, match="different sizes"):
        list(ds_a.batches(3))
    ds_a.transform = P.resize_center_crop(12, 8)
    ((x, y),) = list(ds_a.batches(3))
    assert x.shape == (3, 8, 8, 3) and y.tolist() == [6, 11, 900]


def test_load_wnids_formats(tmp_path):
    wnids = ["n01440764", "n01443537"]
    (tmp_path / "list.json").write_text(json.dumps(wnids))
    (tmp_path / "index.json").write_text(
        json.dumps({"1": ["n01443537", "goldfish"], "0": ["n01440764", "tench"]})
    )
    (tmp_path / "LOC_synset_mapping.txt").write_text("n01440764 tench, Tinca tinca\nn01443537 goldfish\n")
    for w in wnids:
        (tmp_path / "train" / w).mkdir(parents=True)
    for src in ("list.json", "index.json", "LOC_synset_mapping.txt", "train"):
        assert P.load_wnids(tmp_path / src) == wnids, src
    (tmp_path / "bad.txt").write_text("tench\n")
    with pytest.raises(ValueError, match="not ImageNet wnids"):
        P.load_wnids(tmp_path / "bad.txt")
    with pytest.raises(ValueError, match="duplicate"):
        P.load_wnids(wnids + wnids[:1])


def test_subset_evaluation_on_a_public_tree(tmp_path):
    """End to end: an ImageNet-R-like tree, a 5-class 'head' model, evaluation restricted to the subset."""
    import torch
    from torch import nn

    full = [f"n{i:08d}" for i in range(5)]
    for k, w in ((0, full[1]), (1, full[3])):
        for j in range(3):
            _jpeg(tmp_path / w / f"{j}.png", 200 if k else 30, size=6)
    ds, subset = P.read_imagenet_r(tmp_path, full)

    class Bright(nn.Module):  # logit of class 3 grows with brightness, class 1 falls; class 0 always wins
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            m = x.mean(dim=(1, 2, 3))
            return torch.stack([m * 0 + 100, -m, m * 0, m, m * 0], dim=1)

    correct, n = count_correct(Bright(), ds.batches(4), mean=[0.5] * 3, std=[0.5] * 3, class_subset=subset)
    assert (correct, n) == (6, 6)
    correct, _ = count_correct(Bright(), ds.batches(4), mean=[0.5] * 3, std=[0.5] * 3)
    assert correct == 0  # without the subset, class 0 (absent from ImageNet-R) takes every image
