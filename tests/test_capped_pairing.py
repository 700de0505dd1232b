"""The paired bootstrap pairs each corrupted image with its own clean original when ``data.limit`` caps the test
split: a corrupted set indexes the uncapped split (or its test half), the clean rows of the capped split are
numbered by position, and evaluate maps one onto the other (core.data.capped_test_positions,
core.robustness.evaluation.evaluate_model's ``clean_index``).

The truth: a "corruption" that is the identity gives every corrupted image its original's pixels, so a model
must be right or wrong on both alike; without the mapping the rows pair other images and disagree."""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc
import pytest
import torch

from core.data import capped_test_positions, half_split
from core.data.splits import stratified_head
from core.robustness.corruption_store import StoredSet
from core.robustness.evaluation import evaluate_model

rng = np.random.default_rng(0)
IMAGES = rng.integers(0, 256, size=(400, 8, 8, 1), dtype=np.uint8)
CAP, N_SET = 120, 120  # data.limit.test and robustness.n_images (at most the cap: the selection nests)


class Net(torch.nn.Module):  # a fixed linear map: the same image, the same prediction
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def _labels() -> np.ndarray:
    """Labels the model gets right on about half the images, at random: rows that pair other images then
    disagree on about half of them."""
    with torch.no_grad():
        x = (torch.from_numpy(IMAGES).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.25
        predicted = Net()(x).argmax(1).numpy()
    return np.where(rng.random(len(IMAGES)) < 0.5, predicted, (predicted + 1) % 10)


LABELS = _labels()


def _rows(val_from: str, clean_index: bool) -> tuple[np.ndarray, np.ndarray]:
    """(clean correct by position, identity-set correct at each row's paired clean position)."""
    base = np.arange(len(LABELS)) if val_from == "train" else half_split(LABELS)[1]
    cap = capped_test_positions(LABELS, val_from=val_from, limit={"test": CAP})
    assert cap is not None and np.array_equal(cap, stratified_head(LABELS[base], CAP))
    clean = (IMAGES[base][cap], LABELS[base][cap])
    picked = stratified_head(LABELS[base], N_SET)  # the corrupt stage's selection, as positions in ``base``
    identity = StoredSet(IMAGES[base][picked], LABELS[base][picked], picked, {"meaningful": True})
    _, per_image = evaluate_model(
        Net().eval(), clean, lambda c, s: identity, ["contrast"], [1], mean=[0.5], std=[0.25],
        per_image=True, clean_index=cap if clean_index else None,
    )  # fmt: skip
    is_clean = pc.equal(per_image["corruption"].cast("string"), "clean")
    ok_clean = per_image.filter(is_clean)["correct"].to_numpy(zero_copy_only=False)
    rows = per_image.filter(pc.invert(is_clean))
    idx, ok = rows["index"].to_numpy(), rows["correct"].to_numpy(zero_copy_only=False)
    inside = idx < len(ok_clean)  # unmapped, some indices point past the capped split altogether
    return ok_clean[idx[inside]], ok[inside]


@pytest.mark.parametrize("val_from", ["train", "test_half"])
def test_each_corrupted_image_pairs_with_its_own_original_under_a_cap(val_from: str) -> None:
    paired_clean, corrupted = _rows(val_from, clean_index=True)
    assert np.array_equal(paired_clean, corrupted)
    unmapped_clean, unmapped = _rows(val_from, clean_index=False)  # positions read as indices: other images
    assert not np.array_equal(unmapped_clean, unmapped)


def test_an_uncapped_split_and_a_set_outside_the_cap() -> None:
    assert capped_test_positions(LABELS, limit=None) is None
    assert capped_test_positions(LABELS, limit={"test": 10_000}) is None
    cap = capped_test_positions(LABELS, limit={"test": CAP})
    outside = np.setdiff1d(np.arange(len(LABELS)), cap)[:3]
    stray = StoredSet(IMAGES[outside], LABELS[outside], outside, {"meaningful": True})
    with pytest.raises(ValueError, match="not in the capped test split"):
        evaluate_model(Net().eval(), (IMAGES[cap], LABELS[cap]), lambda c, s: stray, ["contrast"], [1],
                       mean=[0.5], std=[0.25], per_image=True, clean_index=cap)  # fmt: skip
