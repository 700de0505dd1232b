"""BatchLoader: contract shapes, exact resume, determinism, and augmentations against independent truths."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.data.mixup import mixup_target
from torchvision.transforms.v2 import functional as TF

from core.config import AugmentConfig
from core.data import BatchLoader
from core.data.loader import _posterize_safe, build_randaugment, crop_flip

MEAN, STD = [0.3], [0.25]
NONE = AugmentConfig(crop_padding=0, hflip=False)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (203, 12, 12, 1), dtype=np.uint8), rng.integers(0, 10, 203).astype(np.int64)


@pytest.fixture(scope="module")
def rgb() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, (64, 10, 10, 3), dtype=np.uint8), rng.integers(0, 5, 64).astype(np.int64)


def make(data, **kw) -> BatchLoader:
    images, labels = data
    args = dict(batch_size=32, train=True, seed=0, mean=MEAN, std=STD, augment=AugmentConfig())
    args.update(kw)
    return BatchLoader(images, labels, **args)


def collect(loader: BatchLoader, epoch: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader.batches(epoch, start_step=start))


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)
    )


def test_lengths_and_contract_types(data) -> None:
    train = make(data)
    assert len(train) == 203 // 32 == 6  # drop_last defaults to train
    evl = make(data, train=False)
    assert len(evl) == 7
    batches = collect(evl, 0)
    assert [len(y) for _, y in batches] == [32] * 6 + [11]
    x, y = collect(train, 0)[0]
    assert x.dtype == torch.float32 and x.shape == (32, 1, 12, 12) and x.is_contiguous()
    assert y.dtype == torch.int64 and y.shape == (32,)


def test_eval_is_file_order_and_exact_normalization(data) -> None:
    images, labels = data
    batches = collect(make(data, train=False, batch_size=50), epoch=3)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    expected = (torch.from_numpy(images).permute(0, 3, 1, 2).double() / 255 - MEAN[0]) / STD[0]
    assert torch.equal(y, torch.from_numpy(labels))
    assert torch.allclose(x.double(), expected, atol=1e-5)


def test_exact_resume(data) -> None:
    aug = AugmentConfig(crop_padding=2, hflip=True, mixup=0.8, cutmix=1.0, label_smoothing=0.1)
    loader = make(data, augment=aug)
    full = collect(loader, 4)
    for k in (0, 1, 3, len(loader) - 1, len(loader)):
        assert same(collect(loader, 4, start=k), full[k:])


def test_resume_with_randaugment(data) -> None:
    loader = make(data, augment=AugmentConfig(randaugment="rand-m9-mstd0.5-inc1"), batch_size=16)
    full = collect(loader, 1)
    assert same(collect(loader, 1, start=5), full[5:])


def test_deterministic_per_seed_and_epoch(data) -> None:
    a = collect(make(data), 0)
    assert same(a, collect(make(data), 0))
    assert not torch.equal(a[0][0], collect(make(data, seed=1), 0)[0][0])
    b = collect(make(data), 1)
    assert not torch.equal(a[0][0], b[0][0])
    assert not torch.equal(torch.cat([y for _, y in a]), torch.cat([y for _, y in b]))  # different order


def test_epoch_covers_each_sample_once(data) -> None:
    images, labels = data
    loader = make(data, augment=NONE, drop_last=False)
    order = loader.order(2)
    assert sorted(order.tolist()) == list(range(len(labels)))
    y = torch.cat([b[1] for b in collect(loader, 2)])
    assert torch.equal(y, torch.from_numpy(labels[order]))


def test_workers_give_identical_batches(data) -> None:
    aug = AugmentConfig(crop_padding=2, hflip=True, mixup=0.5)
    assert same(collect(make(data, augment=aug, num_workers=2), 1, 2), collect(make(data, augment=aug), 1, 2))


def test_crop_flip_equals_torchvision_per_sample(rgb) -> None:
    images, _ = rgb
    rng = np.random.default_rng(5)
    pad = 3
    dy, dx = rng.integers(0, 2 * pad + 1, size=(2, len(images)))
    flip = rng.random(len(images)) < 0.5
    out = crop_flip(images, pad, dy, dx, flip)
    for i in range(len(images)):
        img = torch.from_numpy(images[i]).permute(2, 0, 1)  # torchvision: [C,H,W]
        ref = TF.crop(TF.pad(img, [pad], fill=0), int(dy[i]), int(dx[i]), 10, 10)
        if flip[i]:
            ref = TF.horizontal_flip(ref)
        assert torch.equal(torch.from_numpy(out[i]).permute(2, 0, 1), ref), i


def test_default_augmentation_moves_pixels_within_padding(data) -> None:
    images, _ = data
    loader = make(data, augment=AugmentConfig(crop_padding=2, hflip=True), batch_size=203, drop_last=False)
    x, _ = collect(loader, 0)[0]
    plain = (torch.from_numpy(images[loader.order(0)]).permute(0, 3, 1, 2).float() / 255 - MEAN[0]) / STD[0]
    changed = (~torch.isclose(x, plain, atol=1e-5)).flatten(1).any(1).float().mean()
    assert 0.5 < changed <= 1.0  # most images shifted or flipped (P(no change) = 1/25 * 1/2)
    fill = (0 - MEAN[0]) / STD[0]  # zero padding, normalized
    assert (x == torch.tensor(fill)).any()


def test_mixup_matches_timm_targets_and_blend(data) -> None:
    base = make(data, augment=AugmentConfig(crop_padding=2, hflip=True))
    mixed = make(data, augment=AugmentConfig(crop_padding=2, hflip=True, mixup=0.4, label_smoothing=0.0))
    for step in range(3):
        (x0, y0), (x1, t1) = base.batch(0, step), mixed.batch(0, step)
        assert t1.shape == (32, 10)
        i = int(torch.nonzero(y0 != y0.flip(0))[0])
        lam = float(t1[i, y0[i]])  # with smoothing 0, the own class's weight is lambda
        assert torch.allclose(t1, mixup_target(y0, 10, lam, 0.0), atol=1e-6)
        assert torch.allclose(x1, lam * x0 + (1 - lam) * x0.flip(0), atol=1e-5)


def test_cutmix_box_and_corrected_lambda(data) -> None:
    base = make(data, augment=NONE)
    mixed = make(data, augment=NONE.model_copy(update={"cutmix": 1.0, "label_smoothing": 0.1}))
    boxes = 0
    for step in range(5):
        (x0, y0), (x1, t1) = base.batch(2, step), mixed.batch(2, step)
        from_flip = (x1 == x0.flip(0)).all(1) & (x1 != x0).any(1)  # [B,H,W]: pixel came from the partner
        region = from_flip.any(0)
        rows, cols = torch.nonzero(region.any(1)).flatten(), torch.nonzero(region.any(0)).flatten()
        if len(rows):
            boxes += 1
            box = torch.zeros_like(region)
            box[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1] = True
            assert torch.equal(region, box)  # one rectangle
            keep = ~box
            assert torch.equal(x1[:, :, keep], x0[:, :, keep])
            area = float(box.sum()) / box.numel()
        else:
            area = 0.0
        assert torch.allclose(t1, mixup_target(y0, 10, 1.0 - area, 0.1), atol=1e-6)
    assert boxes >= 3


def test_randaugment_deterministic_changes_images_and_leaves_global_rng(data) -> None:
    state_py, state_np = random.getstate(), np.random.get_state()[1].copy()
    plain = make(data, augment=NONE).batch(0, 0)[0]
    ra = make(data, augment=NONE.model_copy(update={"randaugment": "rand-m9-mstd0.5-inc1"}))
    a, b = ra.batch(0, 0)[0], ra.batch(0, 0)[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, plain)
    assert random.getstate() == state_py and np.array_equal(np.random.get_state()[1], state_np)


def test_randaugment_posterize_zero_bits_is_black_not_an_error() -> None:
    from PIL import Image

    img = Image.fromarray(np.full((8, 8), 200, np.uint8), "L")
    assert np.asarray(_posterize_safe(img, 0)).max() == 0
    assert np.asarray(_posterize_safe(img, 1)).max() == 128
    t = build_randaugment("rand-m9-mstd0.5-inc1", 28, MEAN)
    assert all(op.aug_fn is _posterize_safe for op in t.ops if op.name.startswith("Posterize"))
    with pytest.raises(ValueError, match="augment.randaugment"):
        build_randaugment("rand-bogus7", 28, MEAN)


def test_rgb_randaugment_and_mixing_run(rgb) -> None:
    aug = AugmentConfig(crop_padding=1, randaugment="rand-m7-n2", mixup=0.8, cutmix=1.0)
    loader = BatchLoader(*rgb, batch_size=16, train=True, seed=3, mean=[0.5] * 3, std=[0.2] * 3, augment=aug)
    x, t = next(loader.batches(0))
    assert x.shape == (16, 3, 10, 10) and t.shape == (16, 5)
    assert torch.allclose(t.sum(1), torch.ones(16))


def test_resize_to_image_size(data) -> None:
    images, _ = data
    up = make(data, train=False, image_size=24)
    x, _ = collect(up, 0)[0]
    assert x.shape == (32, 1, 24, 24)
    ref = (torch.from_numpy(images[:32]).permute(0, 3, 1, 2).float() / 255 - MEAN[0]) / STD[0]
    assert torch.allclose(
        x, F.interpolate(ref, size=(24, 24), mode="bilinear", align_corners=False), atol=1e-5
    )
    down = make(data, image_size=8)
    assert collect(down, 0)[0][0].shape == (32, 1, 8, 8)


def test_bad_inputs(data) -> None:
    images, labels = data
    with pytest.raises(ValueError, match="uint8"):
        BatchLoader(images.astype(np.float32), labels, batch_size=4, train=True, seed=0, mean=MEAN, std=STD)
    with pytest.raises(ValueError, match="channel"):
        BatchLoader(images, labels, batch_size=4, train=True, seed=0, mean=[0.1] * 3, std=[0.2] * 3)
    loader = make(data)
    with pytest.raises(ValueError, match="start_step"):
        next(loader.batches(0, start_step=len(loader) + 1))
