"""Data-loading benchmark (issue 2): the Parquet loader's images/s against in-memory arrays, and against the
rate at which the default model trains.

    .venv/bin/python benchmarks/data.py [--data-dir data/fashion_mnist] [--epochs 3] [--train-rounds 5]

Measured side by side in one process (timings on a shared 2-core machine are noisy; the ratios are what
count), batch 256, the default worker count (params.yaml data.num_workers) and the default training
augmentation (params.yaml pretrain.augment: 2-pixel padded random crop + horizontal flip):

- parquet:  ``load_split`` (read + SHA-256 verify the shards) + ``BatchLoader`` epochs; "first epoch"
  charges the whole read cost to one epoch (``load_split`` runs once per stage), "steady" leaves it out.
  Epoch times are medians over --epochs epochs, interleaved with the memory/batch epochs.
- memory/batch: the same ``BatchLoader`` over the arrays parsed straight from the IDX files (no Parquet).
- memory/torch: the textbook in-memory baseline, a map-style Dataset over the same uint8 tensor with
  torchvision's per-sample RandomCrop(padding) + RandomHorizontalFlip + Normalize and a DataLoader.
- train: SGD steps (momentum 0.9, weight decay 5e-4) of ``build("cnn", "resnet10_cifar", 10, in_chans=1)``,
  in rounds alternating with rounds of loader batches (medians of each: the robust ratio on a busy machine).

Goals: parquet >= 0.5x in-memory and >= 20x the training rate.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.config import load_params  # noqa: E402
from core.data import BatchLoader, import_dataset, load_split, parse_idx, read_manifest, verify_split  # noqa: E402

BATCH = 256


def prepared_dir(data_dir: Path, tmp: Path) -> Path:
    try:
        read_manifest(data_dir)
        verify_split(data_dir, "train")
        return data_dir
    except Exception:
        out = tmp / "fashion_mnist"
        print(f"benchmark: {data_dir} not prepared; importing Fashion-MNIST into {out}")
        import_dataset("fashion_mnist", None, out)
        return out


def raw_idx_arrays(manifest: dict) -> tuple[np.ndarray, np.ndarray]:
    base = Path(manifest["source"]["path"])

    def read(name: str) -> np.ndarray:
        path = base / f"{name}.gz"
        return parse_idx(gzip.decompress(path.read_bytes()) if path.exists() else (base / name).read_bytes())

    return read("train-images-idx3-ubyte")[..., None].copy(), read("train-labels-idx1-ubyte").astype(np.int64)


def epoch_rate(loader: BatchLoader, epoch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for x, _ in loader.batches(epoch):
        n += len(x)
    return time.perf_counter() - t0, n


def torch_baseline(
    images: np.ndarray, labels: np.ndarray, mean, std, pad: int, workers: int, limit: int
) -> float:
    from torchvision.transforms import v2

    h = images.shape[1]
    tf = v2.Compose([v2.RandomCrop(h, padding=pad), v2.RandomHorizontalFlip(), v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize(mean, std)])  # fmt: skip
    x = torch.from_numpy(images).permute(0, 3, 1, 2)  # [N,C,H,W] uint8, in memory
    y = torch.from_numpy(labels)

    class PerSample(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int):
            return tf(x[i]), y[i]

    dl = torch.utils.data.DataLoader(
        PerSample(), batch_size=BATCH, shuffle=True, num_workers=workers, drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    t0 = time.perf_counter()
    n = 0
    for xb, _ in dl:
        n += len(xb)
        if n >= limit:
            break
    return n / (time.perf_counter() - t0)


def train_vs_loader(
    loader: BatchLoader, rounds: int, steps: int, loader_steps: int = 24
) -> tuple[float, float]:
    """Median images/s of SGD training and of the loader, measured in alternating rounds, so that a shared
    machine's changing load hits both alike."""
    from core.models.factory import build

    model = build("cnn", "resnet10_cifar", 10, in_chans=1).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    batches = [loader.batch(0, s) for s in range(steps)]
    for x, y in batches[:2]:  # warm-up (allocator, kernels)
        step(x, y)
    train, load = [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        for x, y in batches:
            step(x, y)
        train.append(steps * BATCH / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for k in range(loader_steps):
            loader.batch(1 + r, k)
        load.append(loader_steps * BATCH / (time.perf_counter() - t0))
    return float(np.median(train)), float(np.median(load))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(REPO / "params.yaml"))
    ap.add_argument("--data-dir", default=None, help="prepared dataset (default: params data.dir)")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train-rounds", type=int, default=5)
    ap.add_argument("--train-steps", type=int, default=3, help="SGD steps per round")
    ap.add_argument(
        "--baseline-images", type=int, default=15360, help="images timed for the per-sample baseline"
    )
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the machine has 2 cores)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    params = load_params(args.params)
    aug, workers = params.pretrain.augment, params.data.num_workers
    data_dir = Path(args.data_dir) if args.data_dir else REPO / params.data.dir

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = prepared_dir(data_dir, Path(tmp))
        m = read_manifest(data_dir)
        mean, std = m["mean"], m["std"]

        t0 = time.perf_counter()
        images, labels = load_split(data_dir, "train")
        t_load = time.perf_counter() - t0
        kw = dict(batch_size=BATCH, train=True, seed=0, mean=mean, std=std, augment=aug, num_workers=workers)
        parquet = BatchLoader(images, labels, **kw)
        raw_x, raw_y = raw_idx_arrays(m)
        assert np.array_equal(raw_x, images) and np.array_equal(raw_y, labels)
        mem = BatchLoader(raw_x, raw_y, **kw)
        times, mem_times = [], []
        for e in range(args.epochs):  # interleaved, so load drift on a shared machine hits both alike
            times.append(epoch_rate(parquet, e))
            mem_times.append(epoch_rate(mem, e))
        n_epoch = times[0][1]
        t_epoch = float(np.median([t for t, _ in times]))
        pq_first = n_epoch / (t_load + t_epoch)
        pq_steady = n_epoch / t_epoch
        mem_rate = n_epoch / float(np.median([t for t, _ in mem_times]))
        torch_rate = torch_baseline(raw_x, raw_y, mean, std, aug.crop_padding, workers, args.baseline_images)
        tr_rate, ld_rate = train_vs_loader(parquet, args.train_rounds, args.train_steps)

    res = {
        "images": int(n_epoch),
        "load_split_s": round(t_load, 3),
        "parquet_first_epoch_img_s": round(pq_first),
        "parquet_steady_img_s": round(pq_steady),
        "memory_batchloader_img_s": round(mem_rate),
        "memory_torch_per_sample_img_s": round(torch_rate),
        "train_img_s": round(tr_rate, 1),
        "loader_img_s_beside_train": round(ld_rate),
        "ratio_parquet_first_vs_memory_batchloader": round(pq_first / mem_rate, 3),
        "ratio_parquet_steady_vs_memory_batchloader": round(pq_steady / mem_rate, 3),
        "ratio_parquet_first_vs_memory_torch": round(pq_first / torch_rate, 2),
        "ratio_loader_vs_train": round(ld_rate / tr_rate, 1),
    }
    lines = [
        f"batch {BATCH}, num_workers {workers}, augment crop_padding={aug.crop_padding} hflip={aug.hflip}, "
        f"torch threads {torch.get_num_threads()}",
        f"  load_split(train), SHA-256 verified   : {t_load:8.3f} s",
        f"  parquet  first epoch, incl. load      : {pq_first:9.0f} img/s",
        f"  parquet  steady epoch                 : {pq_steady:9.0f} img/s",
        f"  memory   BatchLoader over IDX arrays  : {mem_rate:9.0f} img/s",
        f"  memory   torch per-sample DataLoader  : {torch_rate:9.0f} img/s",
        f"  train    resnet10_cifar SGD           : {tr_rate:9.1f} img/s",
        f"  loader   rounds beside the training   : {ld_rate:9.0f} img/s",
        f"  parquet(first) / memory BatchLoader   : {pq_first / mem_rate:6.2f}x  (goal >= 0.5)",
        f"  parquet(steady) / memory BatchLoader  : {pq_steady / mem_rate:6.2f}x",
        f"  parquet(first) / memory torch         : {pq_first / torch_rate:6.1f}x  (goal >= 0.5)",
        f"  loader / train                        : {ld_rate / tr_rate:6.1f}x  (goal >= 20)",
    ]
    print("\n".join(lines))
    print(json.dumps(res))
    ok = min(pq_first / mem_rate, pq_first / torch_rate) >= 0.5 and ld_rate / tr_rate >= 20
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
