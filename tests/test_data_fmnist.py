"""Fashion-MNIST from the real Debian IDX files: bit-exact round trip, manifest, source verification."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
from torchvision.datasets.mnist import read_image_file, read_label_file

import core.data.importers as importers
from core.data import DataError, import_dataset, load_split, read_manifest

FMNIST = Path("/usr/share/datasets/fashion-mnist")
NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# Published by Zalando (README of zalandoresearch/fashion-mnist): MD5 of the .gz files, and the MD5s of the
# decompressed files as listed by several independent loaders; written out here, not imported from core.
GZ_MD5 = ["8d4fb7e6c68d591d4c3dfef9ec88bf0d", "25c81989df183df01b3e8a0aad5dffbe",
          "bef4ecab320f06d8554ea6380940ec79", "bb300cfdad3c16e7a12a480ee83cd310"]  # fmt: skip
IDX_MD5 = ["f4a8712d7a061bf5bd6d2ca38dc4d50a", "9018921c3c673c538a1fc5bad174d6f9",
           "8181f5470baa50b63fa0f6fddb340f0a", "15d484375f8d13e6eb1aabb0c3f46965"]  # fmt: skip

pytestmark = pytest.mark.skipif(
    not all((FMNIST / f"{n}.gz").is_file() for n in NAMES),
    reason="Debian dataset-fashion-mnist not installed",
)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The IDX arrays parsed by torchvision's reader (independent of core/data/importers.py's parser)."""
    d = tmp_path_factory.mktemp("idx")
    out = {}
    for n in NAMES:
        (d / n).write_bytes(gzip.decompress((FMNIST / f"{n}.gz").read_bytes()))
        reader = read_image_file if "images" in n else read_label_file
        out[n] = reader(str(d / n)).numpy()
    return out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fm") / "fashion_mnist"
    result = import_dataset("fashion_mnist", None, out, shard_rows=7000, allow_download=False)
    assert not result.skipped
    return out


def test_round_trip_is_bit_exact(prepared: Path, raw: dict[str, np.ndarray]) -> None:
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = load_split(prepared, split)
        assert images.dtype == np.uint8 and images.shape[1:] == (28, 28, 1) and images.flags.c_contiguous
        assert labels.dtype == np.int64
        assert np.array_equal(images[..., 0], raw[f"{prefix}-images-idx3-ubyte"])
        assert np.array_equal(labels, raw[f"{prefix}-labels-idx1-ubyte"].astype(np.int64))


def test_manifest(prepared: Path) -> None:
    m = read_manifest(prepared)
    assert m["dataset"] == "fashion_mnist" and m["image_encoding"] == "raw"
    assert m["image_shape"] == [28, 28, 1] and m["num_classes"] == 10 and len(m["label_names"]) == 10
    assert m["label_names"][0] == "T-shirt/top" and m["label_names"][9] == "Ankle boot"
    assert m["splits"]["train"]["num_rows"] == 60000 and m["splits"]["test"]["num_rows"] == 10000
    assert m["splits"]["train"]["class_counts"] == [6000] * 10  # balanced, as published
    assert m["splits"]["test"]["class_counts"] == [1000] * 10
    assert [f["rows"] for f in m["splits"]["train"]["files"]] == [7000] * 8 + [4000]
    files = m["source"]["files"]
    assert [files[f"{n}.gz"]["content_md5"] for n in NAMES] == IDX_MD5
    for n, gz in zip(NAMES, GZ_MD5):
        info = files[f"{n}.gz"]
        assert info["verified"] in (
            "published MD5 of the .gz file",
            "published MD5 of the decompressed IDX file",
        )
        assert (info["md5"] == gz) == (info["verified"] == "published MD5 of the .gz file")
    # The commonly used Fashion-MNIST normalization constants: mean 0.2860, std 0.3530.
    assert m["mean"][0] == pytest.approx(0.2860, abs=1e-4) and m["std"][0] == pytest.approx(0.3530, abs=1e-4)


def test_reimport_is_skipped_and_byte_identical(prepared: Path, tmp_path: Path) -> None:
    again = import_dataset("fashion_mnist", None, prepared, shard_rows=7000, allow_download=False)
    assert again.skipped
    other = import_dataset("fashion_mnist", FMNIST, tmp_path / "fm", shard_rows=7000, allow_download=False)
    assert not other.skipped
    a, b = read_manifest(prepared)["splits"], other.manifest["splits"]
    assert [f["sha256"] for s in a.values() for f in s["files"]] == [
        f["sha256"] for s in b.values() for f in s["files"]
    ]


def _copy_source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for n in NAMES:
        shutil.copy(FMNIST / f"{n}.gz", src / f"{n}.gz")
    return src


def test_altered_source_file_is_named(tmp_path: Path) -> None:
    src = _copy_source(tmp_path)
    labels = bytearray(gzip.decompress((src / "train-labels-idx1-ubyte.gz").read_bytes()))
    labels[100] = (labels[100] + 1) % 10  # one wrong label, still a valid gzip and a valid IDX file
    (src / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(bytes(labels)))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte\.gz: MD5 .* matches neither"):
        import_dataset("fashion_mnist", src, tmp_path / "out", allow_download=False)
    assert not (tmp_path / "out").exists()


def test_truncated_gzip_is_named(tmp_path: Path) -> None:
    src = _copy_source(tmp_path)
    path = src / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: not a valid gzip file"):
        import_dataset("fashion_mnist", src, tmp_path / "out", allow_download=False)


def test_uncompressed_idx_files_are_accepted(tmp_path: Path, raw: dict[str, np.ndarray]) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    for n in NAMES:
        (src / n).write_bytes(gzip.decompress((FMNIST / f"{n}.gz").read_bytes()))
    result = import_dataset("fashion_mnist", src, tmp_path / "out", allow_download=False)
    assert result.manifest["source"]["files"]["t10k-labels-idx1-ubyte"]["md5"] == IDX_MD5[3]
    assert np.array_equal(load_split(tmp_path / "out", "test")[1], raw["t10k-labels-idx1-ubyte"])


def test_missing_source_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=f"{tmp_path}: the four Fashion-MNIST IDX files"):
        import_dataset("fashion_mnist", tmp_path, tmp_path / "out")


def test_download_fallback_through_torchvision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No internet here: a stand-in for torchvision.datasets.FashionMNIST puts the files where it would."""
    import torchvision.datasets

    calls = []

    class FakeFashionMNIST:
        def __init__(self, root: str, train: bool, download: bool) -> None:
            calls.append((root, train, download))
            raw_dir = Path(root) / "FashionMNIST" / "raw"
            raw_dir.mkdir(parents=True, exist_ok=True)
            for n in NAMES:
                shutil.copy(FMNIST / f"{n}.gz", raw_dir / f"{n}.gz")

    monkeypatch.setattr(importers, "FASHION_MNIST_DIR", tmp_path / "absent")
    monkeypatch.setenv("TCNN_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", FakeFashionMNIST)
    result = import_dataset("fashion_mnist", None, tmp_path / "out")
    assert calls and all(download for _, _, download in calls)
    assert result.manifest["source"]["path"] == str((tmp_path / "cache" / "FashionMNIST" / "raw").resolve())
    assert result.manifest["splits"]["test"]["num_rows"] == 10000

    class Offline:
        def __init__(self, **_: object) -> None:
            raise OSError("Name or service not known")

    monkeypatch.setenv("TCNN_DATA_CACHE", str(tmp_path / "cache2"))
    monkeypatch.setattr(torchvision.datasets, "FashionMNIST", Offline)
    with pytest.raises(
        DataError, match=r"absent: Fashion-MNIST IDX files not found, and .*download .*failed"
    ):
        import_dataset("fashion_mnist", None, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
