"""A published robustness benchmark (`robustness.public`: CIFAR-10-C and the like, [Hendrycks19]) checked against
this dataset from its files alone -- the .npy headers and the labels, never the images -- so that a set evaluate
would refuse is refused before any training: by `tcnn validate`, by the `check` stage that `dvc repro` runs right
after prepare (stages/check.py), and by evaluate again before any model loads (stages/evaluate.py).

Failures are `StageError`s that name the file.
"""

from __future__ import annotations

from pathlib import Path

from core.config import Params
from core.data import DataError, read_manifest
from stages.harness.runner import StageError


def _test_images(
    params: Params, root: Path, prepared: bool
) -> tuple[int | None, list[int] | None, int | None]:
    """(test images, [H, W, C] of the stored images, classes): from the prepared data's manifest, or, before
    prepare has run (``prepared`` false and no manifest), from what the dataset's name says (core.data.catalog:
    Fashion-MNIST 28 x 28 x 1, CIFAR 32 x 32 x 3; an ImageFolder tree says nothing until it is prepared)."""
    try:
        manifest = read_manifest(root / params.data.dir)
    except (DataError, FileNotFoundError, ValueError) as err:
        if prepared or (root / params.data.dir / "manifest.json").exists():
            raise StageError(f"data.dir: {err} (run the prepare stage)") from None
        from core.data.catalog import DATASETS

        ds = DATASETS[params.data.name]
        known = None not in (ds.image_size, ds.channels, ds.num_classes)
        shape = [ds.image_size, ds.image_size, ds.channels] if known else None
        return None, shape, ds.num_classes if known else None
    shape, classes = manifest.get("image_shape"), manifest.get("num_classes")  # a decoded dataset states both
    return int(manifest["splits"]["test"]["num_rows"]), shape, int(classes) if classes else None


def check_public_sets(params: Params, root: Path = Path("."), *, prepared: bool = True) -> None:
    """A published benchmark's files fit this dataset before any model runs: its images have the clean test
    images' shape and channels, its labels are integers of the dataset's classes, one per image
    (core.robustness.public_sets.PublicSets.check; each failure names its file). Only the .npy headers and the
    labels are read. ``prepared`` false (`tcnn validate`, the check stage): the data need not be prepared yet,
    its shape and classes come from the dataset's name where the manifest is not there (issue 59)."""
    from core.robustness.public_sets import PublicSets

    pub, rob = params.robustness.public, params.robustness
    n_clean, shape, classes = _test_images(params, root, prepared)
    try:
        sets = PublicSets(pub.kind, root / pub.dir, params.public_images(), n_clean or 2**62)
        names = sorted({c for c, _ in sets.available} & set(rob.corruptions))
        if shape and classes:
            sets.check(names, shape, classes)
    except (FileNotFoundError, ValueError) as err:
        raise StageError(f"robustness.public: {err}") from None


def check_public_before_training(params: Params, root: Path = Path(".")) -> None:
    """`robustness.public`, when set, checked without the prepared data (the dataset's name gives the image
    size and classes, where the manifest is not there yet): what `tcnn validate` and the check stage run, so
    a set evaluate would refuse is refused before hours of training."""
    if params.robustness.public is not None:
        check_public_sets(params, root, prepared=False)
