"""CIFAR and ImageFolder importers on small inputs the tests create; shard corruption; atomic outputs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from core.data import DataError, ShardDataset, import_dataset, load_split, read_manifest, verify_split

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _pickle(obj: dict) -> bytes:
    # The real batches are Python 2 cPickle files (protocol 2) of dicts with byte-string keys.
    return pickle.dumps(obj, protocol=2)


def _to_cifar_rows(images_hwc: np.ndarray) -> np.ndarray:
    """The documented CIFAR row layout: 1024 red values, 1024 green, 1024 blue, each plane row-major."""
    return np.stack([img.transpose(2, 0, 1).reshape(-1) for img in images_hwc]).astype(np.uint8)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def make_cifar10(path: Path, per_batch: int = 12, n_test: int = 15, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    train = rng.integers(0, 256, (5 * per_batch, 32, 32, 3), dtype=np.uint8)
    train_y = rng.integers(0, 10, 5 * per_batch)
    test = rng.integers(0, 256, (n_test, 32, 32, 3), dtype=np.uint8)
    test_y = rng.integers(0, 10, n_test)
    with tarfile.open(path, "w:gz") as tar:
        for b in range(5):
            sl = slice(b * per_batch, (b + 1) * per_batch)
            batch = {b"batch_label": f"training batch {b + 1} of 5".encode(), b"labels": train_y[sl].tolist(),
                     b"data": _to_cifar_rows(train[sl]), b"filenames": [b"x.png"] * per_batch}  # fmt: skip
            _add(tar, f"cifar-10-batches-py/data_batch_{b + 1}", _pickle(batch))
        _add(tar, "cifar-10-batches-py/test_batch", _pickle(
            {b"batch_label": b"testing batch 1 of 1", b"labels": test_y.tolist(), b"data": _to_cifar_rows(test),
             b"filenames": [b"y.png"] * n_test}))  # fmt: skip
        meta = {
            b"num_cases_per_batch": per_batch,
            b"label_names": [n.encode() for n in CIFAR10_NAMES],
            b"num_vis": 3072,
        }
        _add(tar, "cifar-10-batches-py/batches.meta", _pickle(meta))
        _add(tar, "cifar-10-batches-py/readme.html", b"<html></html>")
    return {"train": (train, train_y), "test": (test, test_y)}


def make_cifar100(path: Path, n_train: int = 40, n_test: int = 10, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    fine = [f"class_{i:02d}" for i in range(100)]
    out = {}
    with tarfile.open(path, "w:gz") as tar:
        for split, n in (("train", n_train), ("test", n_test)):
            images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
            y = rng.integers(0, 100, n)
            batch = {b"filenames": [b"z.png"] * n, b"batch_label": split.encode(), b"fine_labels": y.tolist(),
                     b"coarse_labels": (y // 5).tolist(), b"data": _to_cifar_rows(images)}  # fmt: skip
            _add(tar, f"cifar-100-python/{split}", _pickle(batch))
            out[split] = (images, y)
        meta = {b"fine_label_names": [n.encode() for n in fine], b"coarse_label_names": [b"c"] * 20}
        _add(tar, "cifar-100-python/meta", _pickle(meta))
    out["names"] = fine
    return out


def test_cifar10_archive(tmp_path: Path) -> None:
    truth = make_cifar10(tmp_path / "cifar-10-python.tar.gz")
    result = import_dataset("cifar10", tmp_path / "cifar-10-python.tar.gz", tmp_path / "c10", shard_rows=25)
    m = result.manifest
    assert m["label_names"] == CIFAR10_NAMES and m["num_classes"] == 10 and m["image_shape"] == [32, 32, 3]
    assert [f["rows"] for f in m["splits"]["train"]["files"]] == [25, 25, 10]
    for split in ("train", "test"):
        images, labels = load_split(tmp_path / "c10", split)
        assert np.array_equal(images, truth[split][0]) and np.array_equal(labels, truth[split][1])
        assert m["splits"][split]["class_counts"] == np.bincount(truth[split][1], minlength=10).tolist()
    src = m["source"]["files"]["cifar-10-python.tar.gz"]
    assert src["md5"] == hashlib.md5((tmp_path / "cifar-10-python.tar.gz").read_bytes()).hexdigest()
    assert src["verified"].startswith("differs from the official MD5")  # not the real archive
    train = truth["train"][0].reshape(-1, 3) / 255.0
    assert np.allclose(m["mean"], train.mean(0), atol=1e-6) and np.allclose(m["std"], train.std(0), atol=1e-6)


def test_cifar10_extracted_directory(tmp_path: Path) -> None:
    truth = make_cifar10(tmp_path / "a.tar.gz")
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        tar.extractall(tmp_path / "x", filter="data")
    import_dataset("cifar10", tmp_path / "x", tmp_path / "c10")
    assert np.array_equal(load_split(tmp_path / "c10", "test")[0], truth["test"][0])


def test_cifar100_archive(tmp_path: Path) -> None:
    truth = make_cifar100(tmp_path / "cifar-100-python.tar.gz")
    m = import_dataset("cifar100", tmp_path / "cifar-100-python.tar.gz", tmp_path / "c100").manifest
    assert m["num_classes"] == 100 and m["label_names"] == truth["names"]
    images, labels = load_split(tmp_path / "c100", "train")
    assert np.array_equal(images, truth["train"][0]) and np.array_equal(
        labels, truth["train"][1]
    )  # fine labels


def test_cifar_pickle_with_foreign_globals_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self):
            return (os.getcwd, ())

    with tarfile.open(tmp_path / "evil.tar.gz", "w:gz") as tar:
        for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]:
            _add(tar, f"cifar-10-batches-py/{name}", pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(DataError, match=r"evil\.tar\.gz.*not allowed"):
        import_dataset("cifar10", tmp_path / "evil.tar.gz", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cifar_truncated_archive_is_named(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "c.tar.gz")
    data = (tmp_path / "c.tar.gz").read_bytes()
    (tmp_path / "c.tar.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=r"c\.tar\.gz: unreadable archive"):
        import_dataset("cifar10", tmp_path / "c.tar.gz", tmp_path / "out")


# ----------------------------------------------------------------------------------------------------------
# ImageFolder


def make_tree(
    root: Path, sizes: list[tuple[int, int]] | None = None, seed: int = 0
) -> dict[str, dict[str, str]]:
    """root/{train,val}/{cat,dog,eel}/: PNG (RGB and grayscale) and JPEG files; returns digest -> class."""
    rng = np.random.default_rng(seed)
    classes = {"train": {"cat": 7, "dog": 5, "eel": 4}, "val": {"cat": 2, "dog": 2, "eel": 1}}
    truth: dict[str, dict[str, str]] = {"train": {}, "val": {}}
    k = 0
    for split, counts in classes.items():
        for cls, n in counts.items():
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                h, w = sizes[k % len(sizes)] if sizes else (16, 16)
                k += 1
                kind = i % 3
                if kind == 0:
                    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
                    path = root / split / cls / f"{i}.png"
                elif kind == 1:
                    img = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L")
                    path = root / split / cls / f"{i}.png"
                else:
                    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
                    path = root / split / cls / f"{i}.jpg"
                img.save(path)
                decoded = np.asarray(Image.open(path).convert("RGB"))  # PIL's own decode of the file
                truth[split][hashlib.sha256(decoded.tobytes()).hexdigest()] = cls
    (root / "train" / "cat" / "notes.txt").write_text("not an image, ignored")
    return truth


def test_imagefolder_import(tmp_path: Path) -> None:
    truth = make_tree(tmp_path / "tree")
    result = import_dataset("imagefolder", tmp_path / "tree", tmp_path / "out", shard_rows=6)
    m = result.manifest
    assert m["image_encoding"] == "encoded" and m["image_mode"] == "RGB" and m["image_shape"] == [16, 16, 3]
    assert m["label_names"] == ["cat", "dog", "eel"]
    assert m["splits"]["train"]["class_counts"] == [7, 5, 4] and m["splits"]["test"]["class_counts"] == [
        2,
        2,
        1,
    ]
    assert [f["rows"] for f in m["splits"]["train"]["files"]] == [6, 6, 4]  # streamed shard by shard
    tree = tmp_path / "tree"
    assert m["image_formats"] == {
        "PNG": len(list(tree.rglob("*.png"))),
        "JPEG": len(list(tree.rglob("*.jpg"))),
    }
    assert m["source"]["split_dirs"] == {"train": "train", "test": "val"}
    for split, tsplit in (("train", "train"), ("test", "val")):
        images, labels = load_split(tmp_path / "out", split)
        assert images.shape == (len(truth[tsplit]), 16, 16, 3)
        got = {
            hashlib.sha256(img.tobytes()).hexdigest(): m["label_names"][y] for img, y in zip(images, labels)
        }
        assert got == truth[tsplit]
    # the per-sample Dataset reads the same rows
    ds = ShardDataset(tmp_path / "out", "train")
    images, labels = load_split(tmp_path / "out", "train")
    for i in (0, 5, 6, 15):
        img, y = ds[i]
        assert y == labels[i] and np.array_equal(np.asarray(img), images[i])


def test_imagefolder_variable_sizes_need_image_size(tmp_path: Path) -> None:
    make_tree(tmp_path / "tree", sizes=[(16, 20), (24, 12), (18, 18)])
    m = import_dataset("imagefolder", tmp_path / "tree", tmp_path / "out").manifest
    assert m["image_shape"] is None and m["image_size_range"] == [[16, 20], [24, 12]]
    with pytest.raises(DataError, match="differ in size.*image_size"):
        load_split(tmp_path / "out", "train")
    images, _ = load_split(tmp_path / "out", "train", image_size=12)
    assert images.shape == (16, 12, 12, 3)


def test_imagefolder_broken_image_is_named(tmp_path: Path) -> None:
    make_tree(tmp_path / "tree")
    bad = tmp_path / "tree" / "train" / "dog" / "broken.jpg"
    bad.write_bytes(b"\xff\xd8 this is not a jpeg")
    with pytest.raises(DataError, match=r"broken\.jpg: not a readable image"):
        import_dataset("imagefolder", tmp_path / "tree", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_imagefolder_val_class_unknown_to_train(tmp_path: Path) -> None:
    make_tree(tmp_path / "tree")
    (tmp_path / "tree" / "val" / "yak").mkdir()
    with pytest.raises(DataError, match=r"val: class folder\(s\) \['yak'\]"):
        import_dataset("imagefolder", tmp_path / "tree", tmp_path / "out")


def test_imagefolder_without_split_dirs_is_train_only(tmp_path: Path) -> None:
    make_tree(tmp_path / "tree")
    m = import_dataset("imagefolder", tmp_path / "tree" / "train", tmp_path / "out").manifest
    assert list(m["splits"]) == ["train"] and m["splits"]["train"]["num_rows"] == 16
    with pytest.raises(DataError, match="no split 'test'"):
        load_split(tmp_path / "out", "test")


# ----------------------------------------------------------------------------------------------------------
# corruption, checksums, atomicity


@pytest.fixture
def small(tmp_path: Path) -> Path:
    make_cifar10(tmp_path / "c.tar.gz", per_batch=8, n_test=10)
    import_dataset("cifar10", tmp_path / "c.tar.gz", tmp_path / "ds", shard_rows=16)
    return tmp_path / "ds"


def test_truncated_shard_is_named(small: Path) -> None:
    shard = small / "train-00001.parquet"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(DataError, match=r"train-00001\.parquet: truncated shard"):
        load_split(small, "train")
    with pytest.raises(DataError, match=r"train-00001\.parquet: unreadable shard"):
        load_split(small, "train", verify=False)  # pyarrow's own error, still naming the file
    load_split(small, "test")  # the other split is unaffected


def test_checksum_mismatch_is_named(small: Path) -> None:
    shard = small / "test-00000.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"test-00000\.parquet: checksum mismatch"):
        load_split(small, "test")


def test_missing_shard_and_manifest_are_named(small: Path) -> None:
    (small / "train-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"train-00000\.parquet: missing shard"):
        verify_split(small, "train")
    (small / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"manifest\.json: missing"):
        read_manifest(small)


def test_failed_import_keeps_the_good_output(small: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.read_bytes() for p in small.iterdir()}
    calls = []

    def failing(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:  # train written, then the test split fails
            raise OSError("disk full")
        return real(*args, **kwargs)

    from core.data import shards

    real = shards.write_array_split
    monkeypatch.setattr(shards, "write_array_split", failing)
    with pytest.raises(OSError, match="disk full"):
        import_dataset("cifar10", small.parent / "c.tar.gz", small, shard_rows=16, force=True)
    assert {p.name: p.read_bytes() for p in small.iterdir()} == before
    assert sorted(p.name for p in small.parent.iterdir() if p.name.startswith(".")) == []


def test_damaged_output_is_rebuilt_not_skipped(small: Path) -> None:
    src = small.parent / "c.tar.gz"
    assert import_dataset("cifar10", src, small, shard_rows=16).skipped
    shard = small / "train-00000.parquet"
    shard.write_bytes(b"garbage")
    result = import_dataset("cifar10", src, small, shard_rows=16)
    assert not result.skipped
    verify_split(small, "train")
    assert not import_dataset("cifar10", src, small, shard_rows=8).skipped  # another sharding: rebuilt


def test_refuses_to_replace_a_foreign_directory(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "c.tar.gz")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("keep me")
    with pytest.raises(DataError, match="precious: exists, is not empty and holds no manifest.json"):
        import_dataset("cifar10", tmp_path / "c.tar.gz", tmp_path / "precious")
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "keep me"


def test_stale_temp_dir_of_a_dead_process_is_removed(tmp_path: Path) -> None:
    make_cifar10(tmp_path / "c.tar.gz")
    stale = tmp_path / ".ds.tmp-999999999-abc"  # no such pid
    stale.mkdir()
    import_dataset("cifar10", tmp_path / "c.tar.gz", tmp_path / "ds")
    assert not stale.exists()


def test_manifest_is_json_with_shard_checksums(small: Path) -> None:
    m = json.loads((small / "manifest.json").read_text())
    for entry in m["splits"].values():
        for rec in entry["files"]:
            assert rec["sha256"] == hashlib.sha256((small / rec["name"]).read_bytes()).hexdigest()
            assert rec["bytes"] == (small / rec["name"]).stat().st_size


def test_concurrent_imports_into_one_dir(tmp_path: Path) -> None:
    """Ray trials sharing a data dir: the imports serialize, the later one finds the work done."""
    from concurrent.futures import ThreadPoolExecutor

    make_cifar10(tmp_path / "c.tar.gz")
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(import_dataset, "cifar10", tmp_path / "c.tar.gz", tmp_path / "ds") for _ in range(2)
        ]
        results = [f.result() for f in futures]
    assert sorted(r.skipped for r in results) == [False, True]
    verify_split(tmp_path / "ds", "train")
