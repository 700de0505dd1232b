"""Benchmark: the full 19 x 5 corrupted copy of the 10k Fashion-MNIST test set on 2 cores.

    .venv/bin/python benchmarks/corruptions.py [--data-dir data/fashion_mnist] [--workers 2] [--subset 100]

1. Side by side, on a subset (default 100 images x 19 corruptions x 5 severities, one process, alternating
   rounds so background load hits both alike): "naive" use of the imagecorruptions package -- each image
   converted to RGB (as ``corrupt()`` requires), the package's per-corruption function with its 224 px
   constants, frost re-reading its texture file on every call, ``np.random.seed`` per image, ``seed=`` for
   glass_blur / impulse_noise -- against ``core.robustness.corruptions.corrupt_batch``. Prints both and the ratio.
2. The full run: ``core.robustness.corruptions.iter_sets`` over all 10k images x 95 sets with `--workers` processes
   (spawned, each loading textures and the cached numba kernel once), including worker start-up and
   writing every set to Parquet in a temporary directory. Goal: <= 150 s on 2 cores (naive: ~300 s).

Timings on a shared 2-core machine are noisy; the ratio in (1) is the robust figure.
"""

from __future__ import annotations

import argparse
import gzip
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.robustness import corruptions as C  # noqa: E402

FMNIST = Path("/usr/share/datasets/fashion-mnist")


def load_test(data_dir: Path | None) -> tuple[np.ndarray, np.ndarray]:
    if data_dir is not None:
        from core.data import load_split

        return load_split(data_dir, "test")
    with gzip.open(FMNIST / "t10k-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 28, 28, 1)
    with gzip.open(FMNIST / "t10k-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8).astype(np.int64)
    return images, labels


def naive(images: np.ndarray, seed: int = 0) -> None:
    """The package used as-is, one image at a time."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import imagecorruptions as ic

        for name, fn in ic.corruption_dict.items():
            for s in C.SEVERITIES:
                for i, img in enumerate(images):
                    rgb = np.repeat(img, 3, axis=2)
                    np.random.seed((seed * 1_000_003 + i) % 2**32)
                    kw = {"seed": i} if name in ("glass_blur", "impulse_noise") else {}
                    np.uint8(fn(Image.fromarray(rgb), s, **kw))


def ours(images: np.ndarray, seed: int = 0) -> None:
    for name in C.CORRUPTIONS:
        for s in C.SEVERITIES:
            C.corrupt_batch(images, name, s, seed=seed)


def side_by_side(images: np.ndarray, rounds: int) -> tuple[float, float]:
    """Best-of-`rounds` seconds of naive and ours on the same images, alternating."""
    import imagecorruptions.corruptions as pkg

    pkg._shuffle_pixels_njit_glass_blur(8, 8, np.zeros((8, 8, 3), np.uint8), (0.5, 1, 1), 0)  # compile first
    C.warm_up()
    t_naive, t_ours = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        naive(images)
        t_naive.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ours(images)
        t_ours.append(time.perf_counter() - t0)
    return min(t_naive), min(t_ours)


def _cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def full_run(images: np.ndarray, labels: np.ndarray, workers: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of generating and writing all 95 sets."""
    cpu0 = _cpu_seconds()
    with tempfile.TemporaryDirectory(prefix="tcnn-corrupt-bench-") as tmp:
        idx = np.arange(len(images))
        meta = {"seed": 0, "band": C.band_for_size(28, 28), "image_shape": [28, 28, 1], "n": len(images)}
        t0 = time.perf_counter()
        pairs = [(c, s) for c in C.CORRUPTIONS for s in C.SEVERITIES]
        for c, s, out in C.iter_sets(images, pairs, seed=0, workers=workers, chunk_size=1000, progress=True):
            C.write_set(C.set_path(tmp, c, s), out, labels, idx, C.set_meta(c, s, source="bench", **meta))
        wall = time.perf_counter() - t0
    return wall, _cpu_seconds() - cpu0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, default=None, help="prepared data dir (default: raw IDX files)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--subset", type=int, default=100, help="images in the side-by-side comparison")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-full", action="store_true")
    args = ap.parse_args(argv)
    images, labels = load_test(args.data_dir)
    sub = images[: args.subset]
    cells = len(sub) * len(C.CORRUPTIONS) * len(C.SEVERITIES)
    t_naive, t_ours = side_by_side(sub, args.rounds)
    full_cells = len(images) * len(C.CORRUPTIONS) * len(C.SEVERITIES)
    print(
        f"side by side, {len(sub)} images x 19 x 5 = {cells} corrupted images, 1 process (best of {args.rounds}):"
    )
    print(f"  naive package : {t_naive:7.2f} s  ({1e3 * t_naive / cells:.3f} ms/image)")
    print(f"  core          : {t_ours:7.2f} s  ({1e3 * t_ours / cells:.3f} ms/image)")
    print(f"  ratio naive / core = {t_naive / t_ours:.1f}x")
    print(
        f"  extrapolated to {full_cells} images on {args.workers} cores (perfect scaling): "
        f"naive {t_naive / cells * full_cells / args.workers:.0f} s, core {t_ours / cells * full_cells / args.workers:.0f} s"
    )
    if not args.skip_full:
        load0 = os.getloadavg()[0]
        seconds, cpu = full_run(images, labels, args.workers)
        verdict = "meets" if seconds <= 150 else "MISSES"
        print(
            f"full run: {len(images)} images x 19 x 5 = {full_cells} corrupted images on {args.workers} workers, "
            f"written to Parquet: {seconds:.1f} s wall ({verdict} the 150 s goal); {cpu:.0f} CPU s in all, "
            f"i.e. >= {cpu / args.workers:.0f} s on {args.workers} idle cores; load average "
            f"{load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
