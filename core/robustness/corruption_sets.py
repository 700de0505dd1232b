"""Whole corrupted sets generated in parallel: chunks of images over a pool of spawned worker processes, each set
yielded when complete (see core.robustness.corruptions)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any

import numpy as np

from core.robustness.corruption_ops import check_setting, corrupt_batch, warm_up
from core.robustness.corruption_tables import band_for_size

# ----------------------------------------------------------------------------------------------------------
# Parallel generation of whole sets
# ----------------------------------------------------------------------------------------------------------

#: Rough relative cost per image (28 px, measured) used to start the slow sets first.
_COST = {
    "snow": 5,
    "elastic_transform": 4,
    "jpeg_compression": 3,
    "spatter": 3,
    "motion_blur": 3,
    "glass_blur": 2,
    "zoom_blur": 2,
    "defocus_blur": 2,
    "shot_noise": 2,
    "impulse_noise": 2,
}


def _work(task: tuple[np.ndarray, str, int, int, np.ndarray, str]) -> np.ndarray:
    images, corruption, severity, seed, indices, band = task
    return corrupt_batch(images, corruption, severity, seed=seed, indices=indices, band=band)


def _worker_init() -> None:
    warm_up()


_SINGLE_THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def default_workers() -> int:
    """The cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def _ended_on_error(pool: ProcessPoolExecutor) -> Iterator[ProcessPoolExecutor]:
    """The pool, shut down normally on success; on any error or stop signal (or a generator closed early) its
    queued tasks are cancelled and its worker processes terminated, so none outlives the caller."""
    try:
        yield pool
    except BaseException:
        procs = list((getattr(pool, "_processes", None) or {}).values())  # no public API before Python 3.14
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.terminate()
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.join(5)
        raise
    pool.shutdown(wait=True)


def iter_sets(
    images: np.ndarray,
    pairs: Iterable[tuple[str, int]],
    *,
    seed: int = 0,
    indices: Sequence[int] | np.ndarray | None = None,
    band: str | None = None,
    workers: int | None = None,
    chunk_size: int = 500,
    progress: bool = False,
) -> Iterator[tuple[str, int, np.ndarray]]:
    """Yield ``(corruption, severity, corrupted images)`` for every (corruption, severity) in `pairs`, each
    as soon as it is complete (in no fixed order).

    `images` is uint8 [N, H, W, C]; image i is seeded with ``indices[i]`` (default ``range(N)``; pass the
    images' indices in the full test set so a set's images do not depend on which subset was chosen). Work
    is split into chunks of `chunk_size` images spread over `workers` processes (default: all cores;
    1 = in this process), slow corruptions first; at most 2 chunks per worker are in flight, so memory stays
    bounded by the sets being assembled. Each worker loads the frost textures and the cached numba kernels
    once. The output does not depend on `workers` or `chunk_size`. Workers are spawned (not forked: safe
    after torch / OpenMP initialisation), so a calling script needs ``if __name__ == "__main__":``.
    """
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[3] not in (1, 3):
        raise ValueError(f"images: expected uint8 [N, H, W, 1|3], got {images.dtype} {list(images.shape)}")
    n = len(images)
    indices = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.shape != (n,):
        raise ValueError(f"indices: expected {n} image indices, got shape {list(indices.shape)}")
    pairs = list(dict.fromkeys((str(c), int(s)) for c, s in pairs))
    for c, s in pairs:
        check_setting(c, s, band)
    if n == 0 or not pairs:
        return
    band = band or band_for_size(*images.shape[1:3])
    workers = default_workers() if workers is None else max(1, int(workers))
    chunk_size = max(1, int(chunk_size))
    pairs.sort(key=lambda cs: -_COST.get(cs[0], 1))
    bounds = [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]
    tasks = [(c, s, a, b) for c, s in pairs for a, b in bounds]
    pending = {cs: len(bounds) for cs in pairs}
    buffers: dict[tuple[str, int], np.ndarray] = {}

    bar = None
    if progress:
        import sys  # noqa: PLC0415

        from tqdm.auto import tqdm  # noqa: PLC0415

        bar = tqdm(
            total=len(pairs) * n, unit="img", desc=f"corrupt ({workers} workers)", smoothing=0.05,
            mininterval=0.2 if sys.stderr.isatty() else 5.0,
        )  # fmt: skip

    def finish(c: str, s: int, a: int, b: int, out: np.ndarray) -> tuple[str, int, np.ndarray] | None:
        buf = buffers.get((c, s))
        if buf is None:
            buf = buffers[(c, s)] = np.empty_like(images)
        buf[a:b] = out
        if bar is not None:
            bar.update(b - a)
        pending[(c, s)] -= 1
        return (c, s, buffers.pop((c, s))) if pending[(c, s)] == 0 else None

    def task_args(c: str, s: int, a: int, b: int) -> tuple[np.ndarray, str, int, int, np.ndarray, str]:
        return images[a:b], c, s, seed, indices[a:b], band

    try:
        if workers == 1 or len(tasks) == 1:
            warm_up()
            for c, s, a, b in tasks:
                done = finish(c, s, a, b, _work(task_args(c, s, a, b)))
                if done is not None:
                    yield done
            return
        import multiprocessing as mp  # noqa: PLC0415

        warm_up()  # compiles and caches glass_blur's kernel here, once, before the workers load it

        # spawned workers inherit the environment: one BLAS/OpenMP thread each (the workers are the parallelism)
        saved = {k: os.environ.get(k) for k in _SINGLE_THREAD_ENV}
        os.environ.update({k: "1" for k in _SINGLE_THREAD_ENV})
        try:
            pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init)
            with _ended_on_error(pool):
                queue = iter(tasks)
                in_flight: dict[Any, tuple[str, int, int, int]] = {}

                def submit() -> None:
                    while len(in_flight) < 2 * workers:
                        task = next(queue, None)
                        if task is None:
                            return
                        in_flight[pool.submit(_work, task_args(*task))] = task

                submit()
                while in_flight:
                    finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        c, s, a, b = in_flight.pop(fut)
                        done = finish(c, s, a, b, fut.result())
                        if done is not None:
                            yield done
                    submit()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        if bar is not None:
            bar.close()
