"""StreamLoader: determinism across workers and resumes, data-parallel shards, transforms against torchvision."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from core.data import StreamLoader, import_imagefolder, read_manifest
from core.data.importers import write_array_dataset
from core.data.stream import block_order, crop_params

REPO = Path(__file__).resolve().parents[1]
SIZE = 24


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    """An ImageFolder tree of 70 images of varied sizes (JPEG, plus a PNG and a BMP), imported into shards
    of 20 rows (row groups of 16 and 4 rows: several files and groups)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("stream")
    rng = np.random.default_rng(0)
    files = []
    for i in range(70):
        h, w = (int(v) for v in rng.integers(28, 60, 2))
        ext = {5: "png", 9: "bmp"}.get(i, "JPEG")
        path = root / "tree" / "train" / f"c{i % 3}" / f"{i:03d}.{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path, quality=90)
        files.append(path)
    import_imagefolder(root / "tree", root / "shards", shard_rows=20)
    return root / "shards", sorted(files, key=lambda p: (p.parent.name, p.name))  # the importer's order


def make(tree, **kw) -> StreamLoader:
    args = dict(batch_size=8, train=True, seed=3, image_size=SIZE, shuffle_window=2)
    args.update(kw)
    return StreamLoader(tree[0], "train", **args)


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b)
    )


def truth(path: Path) -> torch.Tensor:
    """The file decoded by PIL, as uint8 [C,H,W] (independent of the loader's decoder and shards)."""
    from PIL import Image

    with Image.open(path) as img:
        return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1)


def test_contract_and_labels(tree) -> None:
    train = make(tree)
    assert len(train) == 70 // 8
    batches = list(train.batches(0))
    x, y = batches[0]
    assert x.dtype == torch.float32 and x.shape == (8, 3, SIZE, SIZE) and y.dtype == torch.int64
    order = train.order(0)
    assert sorted(order) == list(range(70)) and not np.array_equal(order, train.order(1))
    labels = np.array([int(p.parent.name[1]) for p in tree[1]])
    assert np.array_equal(torch.cat([b[1] for b in batches]).numpy(), labels[order[:64]])
    evl = make(tree, train=False)
    assert len(evl) == 9 and [len(b[1]) for b in evl.batches(0)] == [8] * 8 + [6]
    assert np.array_equal(evl.order(0), np.arange(70))
    sub = make(tree, indices=np.arange(10, 40))
    assert sorted(sub.order(0)) == list(range(10, 40))


def test_block_shuffle_keeps_windows() -> None:
    groups = np.repeat(np.arange(10), 16)
    order = block_order(groups, np.random.default_rng(0), window=2)
    assert sorted(order) == list(range(160))
    windows = groups[order].reshape(5, 32)  # each window of 32 rows holds exactly two whole groups
    assert all(len(set(w)) == 2 for w in windows)
    assert len({frozenset(w) for w in windows}) == 5
    assert len(set(groups[block_order(groups, np.random.default_rng(0), window=0)][:32])) > 2


def test_workers_and_resume_give_the_same_batches(tree) -> None:
    ref = list(make(tree).batches(2))
    assert same(ref, list(make(tree, num_workers=2).batches(2)))
    assert same(ref[3:], list(make(tree).batches(2, start_step=3)))
    persistent = make(tree, num_workers=2, persistent_workers=True)
    assert same(ref[5:], list(persistent.batches(2, start_step=5)))
    assert same(ref, list(persistent.batches(2)))
    assert not torch.equal(ref[0][0], next(make(tree, seed=4).batches(2))[0])


@pytest.mark.parametrize("train", [True, False])
def test_data_parallel_shards_union_is_the_single_process_batch(tree, train: bool) -> None:
    whole = list(make(tree, train=train).batches(1))
    shards = [list(make(tree, train=train, rank=r, world_size=2).batches(1)) for r in range(2)]
    assert all(len(s) == len(whole) for s in shards)
    for k, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([shards[0][k][0], shards[1][k][0]]), x)
        assert torch.equal(torch.cat([shards[0][k][1], shards[1][k][1]]), y)
    assert len(shards[0][0][1]) == 4


def test_eval_transform_equals_torchvision(tree) -> None:
    mean, std = read_manifest(tree[0])["mean"], read_manifest(tree[0])["std"]
    tf = v2.Compose([
        v2.Resize(int(SIZE / 0.875)), v2.CenterCrop(SIZE), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ])  # fmt: skip
    loader = make(tree, train=False)
    x = torch.cat([b[0] for b in loader.batches(0)])
    expected = torch.stack([tf(truth(p)) for p in tree[1]])
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=0)


def test_train_crop_equals_resized_crop_with_drawn_params(tree) -> None:
    mean, std = read_manifest(tree[0])["mean"], read_manifest(tree[0])["std"]
    loader = make(tree)
    x, _ = loader.batch(1, 2)
    order = loader.order(1)
    flips = 0
    for i in range(8):
        pos = 2 * 8 + i
        img = truth(tree[1][order[pos]])
        top, left, h, w, flip = loader.augment_params(1, pos, *img.shape[-2:])
        out = TF.resized_crop(img, top, left, h, w, [SIZE, SIZE], antialias=True)
        out = TF.horizontal_flip(out) if flip else out
        expected = TF.normalize(TF.to_dtype(out, torch.float32, scale=True), mean, std)
        torch.testing.assert_close(x[i], expected, atol=1e-5, rtol=0)
        flips += flip
    assert 0 < flips < 8


def test_crop_params_follow_torchvision_bounds() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        height, width = (int(v) for v in rng.integers(20, 400, 2))
        top, left, h, w = crop_params(height, width, rng)
        assert 0 <= top <= height - h and 0 <= left <= width - w and h > 0 and w > 0
        area = h * w / (height * width)
        inside = 0.08 - 0.02 <= area <= 1.0 and 3 / 4 - 0.05 <= w / h <= 4 / 3 + 0.05
        central = (top, left) == ((height - h) // 2, (width - w) // 2)  # torchvision's fallback
        assert inside or central


def test_bad_inputs(tree, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not divisible by world_size"):
        make(tree, batch_size=9, world_size=2, rank=1)
    with pytest.raises(ValueError, match="no images selected"):
        make(tree, indices=[])
    assert len(make(tree, batch_size=100)) == 0  # as BatchLoader: the stages report "no full batch"
    with pytest.raises(ValueError, match="indices outside"):
        make(tree, indices=[70])
    with pytest.raises(ValueError, match="start_step"):
        next(make(tree).batches(0, start_step=99))
    images = np.zeros((4, 8, 8, 3), np.uint8)
    write_array_dataset("raw", tmp_path / "raw", {"train": (images, np.arange(4) % 2)}, ["a", "b"],
                        {"path": "x"}, "f", 10, None)  # fmt: skip
    with pytest.raises(ValueError, match="'raw' images; use BatchLoader"):
        StreamLoader(tmp_path / "raw", "train", batch_size=2, train=True, seed=0)


@pytest.mark.slow
def test_benchmark_quick_prints_rates() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "loader.py"), "--quick"], capture_output=True, text=True,
        timeout=300, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    rows = [r for r in (line.split() for line in out.splitlines()) if r[:1] in (["stream"], ["torchvision"])]
    rows = [r for r in rows if r[1].isdigit()]  # the table, not the summary line
    assert {(r[0], r[1]) for r in rows} == {
        ("stream", "0"),
        ("stream", "2"),
        ("torchvision", "0"),
        ("torchvision", "2"),
    }
    assert all(float(r[2]) > 0 for r in rows)
    assert "to feed a GPU at X img/s you need about" in out


def _class_spread(labels: np.ndarray, rows_per_group: int, window: int, batch: int, epochs: int = 2) -> float:
    """Mean number of distinct classes in a training batch of StreamLoader's order (block_order over row
    groups of ``rows_per_group`` consecutive rows)."""
    from core.data.stream import block_order

    groups = np.arange(len(labels)) // rows_per_group
    spreads = []
    for epoch in range(epochs):
        order = block_order(groups, np.random.default_rng(epoch), window)
        for a in range(0, len(order) - batch + 1, batch * 50):
            spreads.append(len(np.unique(labels[order[a : a + batch]])))
    return float(np.mean(spreads))


def test_interleaved_import_gives_streamed_batches_a_uniform_class_spread() -> None:
    """ImageNet-like: 1000 classes x 1300 images, ~38 JPEGs per 4 MiB row group, window 32, batch 256. Sorted
    rows (classes one after another) give batches of a few dozen classes; rows interleaved at import give
    about the uniform shuffle's expectation, 1000 (1 - (1 - 1/1000)^256) = 226.0 classes."""
    from core.data.imagefolder import interleave

    n_cls, per = 1000, 1300
    items = [(f"{c:04d}/{i:04d}.jpg", c) for c in range(n_cls) for i in range(per)]
    sorted_labels = np.array([y for _, y in items])
    mixed_labels = np.array([y for _, y in interleave(items)])
    uniform = n_cls * (1 - (1 - 1 / n_cls) ** 256)
    s_sorted = _class_spread(sorted_labels, 38, 32, 256)
    s_mixed = _class_spread(mixed_labels, 38, 32, 256)
    assert s_sorted < 70
    assert s_mixed > 0.95 * uniform, (s_sorted, s_mixed, uniform)
    assert sorted(interleave(items)) == sorted(items)  # a permutation of the rows
    assert [y for _, y in interleave(items)][:3] == [0, 1, 2]


def test_a_streamed_dataset_is_prepared_interleaved(tmp_path: Path) -> None:
    from PIL import Image

    from core.data import import_dataset, load_labels

    for c in range(3):
        (tmp_path / "tree" / "train" / f"c{c}").mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (8, 8), (40 * c, i, 0)).save(tmp_path / "tree" / "train" / f"c{c}" / f"{i}.png")
    import_dataset("imagefolder", tmp_path / "tree", tmp_path / "sorted")
    import_dataset("imagefolder", tmp_path / "tree", tmp_path / "mixed", order="interleaved")
    a, b = load_labels(tmp_path / "sorted", "train"), load_labels(tmp_path / "mixed", "train")
    assert sorted(a.tolist()) == sorted(b.tolist())
    k = len(set(a.tolist()))
    assert a.tolist() == sorted(a.tolist()) and len(set(b[:k].tolist())) == k
