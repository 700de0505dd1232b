"""Input-pipeline benchmark: ``StreamLoader`` (224 px training augmentation from encoded Parquet shards)
against the anchor, torchvision's ``ImageFolder`` + ``DataLoader`` on the same JPEGs.

    .venv/bin/python benchmarks/loader.py [--images 2048] [--workers 2] [--rounds 3] [--batch 128] [--quick]

Data: ``--images`` synthetic ImageNet-like JPEGs (smooth random colour fields plus grain, 375-500 px a side,
quality 90, ~75 KB each, 8 classes) written as an ImageFolder tree ``train/<class>/*.JPEG`` in a temporary
directory and imported with ``core.data.import_imagefolder``. Both loaders run RandomResizedCrop(224) +
RandomHorizontalFlip + to float + Normalize, shuffle, batch ``--batch`` and drop the last batch; the anchor
uses torchvision's default PIL loader and transforms v2 on PIL images, the textbook ImageNet recipe.

Measured: whole epochs (worker start-up included, for both alike) at 0 workers (the main process, one torch
thread) and at ``--workers``, in interleaved rounds; medians of images/s. Per core = images/s / max(1,
workers): what one worker process sustains, so that ``cpus_per_trial`` for a GPU consuming X images/s is
about X / (images/s per core), plus one core for the training process itself.

Goal: stream / torchvision >= 1.0 at every worker count. It prints; it does not gate.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.data import StreamLoader, import_imagefolder, read_manifest  # noqa: E402
from core.utils.machine import cpu_model  # noqa: E402

SIZE = 224


def write_jpegs(root: Path, n: int, classes: int = 8, seed: int = 0) -> None:
    """``n`` JPEGs, 375-500 px a side: upsampled colour noise (smooth regions, edges) plus pixel grain, so
    that they compress like photographs (~75 KB at quality 90) rather than like flat colour."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(375, 501, 2))
        base = Image.fromarray(rng.integers(0, 256, (h // 32 + 2, w // 32 + 2, 3), dtype=np.uint8))
        pixels = np.asarray(base.resize((w, h), Image.BICUBIC), np.int16) + rng.normal(0, 12, (h, w, 3))
        out = root / "train" / f"class{i % classes}"
        out.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(out / f"{i:06d}.JPEG", quality=90)


def anchor_loader(root: Path, mean, std, batch: int, workers: int, epoch: int) -> torch.utils.data.DataLoader:
    from torchvision import datasets
    from torchvision.transforms import v2

    tf = v2.Compose([
        v2.RandomResizedCrop(SIZE), v2.RandomHorizontalFlip(), v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
        v2.Normalize(mean, std),
    ])  # fmt: skip
    return torch.utils.data.DataLoader(
        datasets.ImageFolder(str(root / "train"), transform=tf), batch_size=batch, shuffle=True,
        num_workers=workers, drop_last=True, generator=torch.Generator().manual_seed(epoch),
    )  # fmt: skip


def rate(batches) -> float:
    t0, n = time.perf_counter(), 0
    for x, _ in batches:
        n += len(x)
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="384 images, batch 64, one round (< 1 min)")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.rounds, args.batch = 384, 1, 64
    torch.set_num_threads(1)  # workers=0 is one core; DataLoader workers run one thread each anyway
    counts = sorted({0, args.workers})
    with tempfile.TemporaryDirectory(prefix="tcnn-loader-bench-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_jpegs(root / "tree", args.images)
        import_imagefolder(root / "tree", root / "shards", shard_rows=1024)
        manifest = read_manifest(root / "shards")
        mean, std = manifest["mean"], manifest["std"]
        kb = np.mean([p.stat().st_size for p in (root / "tree").rglob("*.JPEG")]) / 1024
        print(
            f"{args.images} JPEGs ({kb:.0f} KB mean), written and imported in {time.perf_counter() - t0:.1f} s"
        )
        stream = {
            w: StreamLoader(root / "shards", "train", batch_size=args.batch, train=True, seed=0,
                            image_size=SIZE, num_workers=w, verify=False)
            for w in counts
        }  # fmt: skip
        stream[0].batch(0, 0)  # warm-up, untimed: torchvision's imports (~1 s), the allocator
        next(iter(anchor_loader(root / "tree", mean, std, args.batch, 0, 0)))
        results: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for w in counts:  # interleaved: a busy machine slows both alike
                results.setdefault(("stream", w), []).append(rate(stream[w].batches(r)))
                anchor = anchor_loader(root / "tree", mean, std, args.batch, w, r)
                results.setdefault(("torchvision", w), []).append(rate(anchor))
    cpu = cpu_model()
    print(f"CPU: {cpu}, {torch.get_num_threads()} torch thread(s) in the main process; batch {args.batch}, "
          f"{args.rounds} round(s), medians")  # fmt: skip
    print(f"{'loader':<12} {'workers':>7} {'images/s':>9} {'per core':>9} {'stream/tv':>9}")
    per_core = {}
    for w in counts:
        tv = statistics.median(results[("torchvision", w)])
        for name in ("stream", "torchvision"):
            ips = statistics.median(results[(name, w)])
            per_core[(name, w)] = ips / max(1, w)
            ratio = f"{ips / tv:9.2f}" if name == "stream" else ""
            print(f"{name:<12} {w:>7} {ips:9.1f} {ips / max(1, w):9.1f} {ratio}")
    w = max(counts)  # the sizing figure comes from worker processes: it includes their IPC cost
    pc = per_core[("stream", w)]
    print(
        f"stream images/s per core at {w} worker(s): {pc:.0f}; to feed a GPU at X img/s you need about "
        f"X / {pc:.0f} cores (e.g. 3000 img/s: ~{3000 / pc:.0f} worker cores + 1 for training)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
