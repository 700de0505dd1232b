"""The training stages on a streamed ImageFolder dataset (`data.stream: true`): prepare -> pretrain -> reparam
-> finetune (with mixup) through core.data.stream, and the result does not depend on the loader's worker count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from core.config import validate_params
from core.data import Mixing, StreamLoader
from core.training.checkpoint import load

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder tree (train/ and val/ as the test split) of JPEGs of varied sizes, 3 classes."""
    from PIL import Image

    root = tmp_path_factory.mktemp("tree")
    rng = np.random.default_rng(0)
    for split, n in (("train", 84), ("val", 24)):
        for i in range(n):
            h, w = (int(v) for v in rng.integers(36, 60, 2))
            c = i % 3
            img = np.clip(rng.normal(60 + 70 * c, 30, (h, w, 3)), 0, 255).astype(np.uint8)  # learnable
            path = root / split / f"c{c}" / f"{i:03d}.JPEG"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(path, quality=90)
    return root


def _params(tree: Path, workers: int) -> object:
    return validate_params(
        {
            "data": {"name": "imagefolder", "source": str(tree), "dir": "data/tree", "stream": True,
                     "image_size": 32, "val_size": 12, "num_workers": workers, "shard_rows": 32},
            "model": {"kind": "tcnn", "arch": "resnet10_cifar"},
            "pretrain": {"epochs": 2, "batch_size": 12, "lr": 0.05, "warmup_epochs": 0.5},
            "reparam": {"epoch": 1},
            "finetune": {"epochs": 1, "batch_size": 12, "augment": {"mixup": 0.2}},
            "tracking": {"enabled": False},
        }
    )  # fmt: skip


def test_streamed_imagefolder_trains_through_the_stages(tree: Path, tmp_path: Path) -> None:
    from stages import finetune, prepare, pretrain, reparam
    from stages.harness import training as T

    finals = []
    for workers in (0, 2):
        root = tmp_path / f"w{workers}"
        params = _params(tree, workers)
        prepare.run(params, root=root)
        ds = T.datasets(params, root)
        assert ds.train_x is None and len(ds.train_y) == 72 and len(ds.val_y) == 12 and len(ds.test_y) == 24
        loaders = T.loaders(
            ds,
            batch_size=12,
            seed=0,
            augment=params.augment_for("finetune"),
            size=32,
            num_workers=params.data.num_workers,
        )
        assert isinstance(loaders.train, Mixing) and isinstance(loaders.test, StreamLoader)
        x, y = next(iter(loaders.train.batches(0)))
        assert x.shape == (12, 3, 32, 32) and y.shape == (12, 3)  # soft targets: mixup is applied

        m = pretrain.run(params, root=root)
        assert m["train_images"] == 72 and m["steps"] == 12
        reparam.run(params, root=root)
        f = finetune.run(params, root=root)
        assert f["epochs_run"] == 1 and np.isfinite(f["test_loss"])
        finals.append(load(root / "runs" / "finetune" / "tcnn-final.pt")["model"])
    # every batch is a function of (seed, epoch, step): DataLoader workers change nothing
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])


def test_stream_needs_an_imagefolder_dataset_and_no_randaugment(tree: Path) -> None:
    from core.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="data.stream"):
        validate_params({"data": {"stream": True}})
    raw = {"data": {"name": "imagefolder", "source": str(tree), "stream": True},
           "augment": {"randaugment": "rand-m9-mstd0.5-inc1"}}  # fmt: skip
    with pytest.raises((ConfigError, ValueError), match="randaugment"):
        validate_params(raw)
