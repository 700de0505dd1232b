"""Whole corrupted sets generated in parallel: chunks of images over a pool of spawned worker processes, each set
yielded when complete (see core.robustness.corruptions)."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
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


def _image_batch(images: np.ndarray) -> np.ndarray:
    """`images` as uint8 [N, H, W, C] with C 1 or 3 (a [N, H, W] batch gains C = 1); anything else is refused."""
    images = np.asarray(images)
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or images.dtype != np.uint8 or images.shape[3] not in (1, 3):
        raise ValueError(f"images: expected uint8 [N, H, W, 1|3], got {images.dtype} {list(images.shape)}")
    return images


def _image_indices(indices: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray:
    """The seed index of each of the `n` images: ``indices`` as int64 [n], default ``range(n)``."""
    indices = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64).reshape(-1)
    if indices.shape != (n,):
        raise ValueError(f"indices: expected {n} image indices, got shape {list(indices.shape)}")
    return indices


def _checked_pairs(pairs: Iterable[tuple[str, int]], band: str | None) -> list[tuple[str, int]]:
    """The distinct (corruption, severity) settings, in first-seen order, each checked against `band`."""
    pairs = list(dict.fromkeys((str(c), int(s)) for c, s in pairs))
    for c, s in pairs:
        check_setting(c, s, band)
    return pairs


def _chunk_tasks(pairs: list[tuple[str, int]], n: int, chunk_size: int) -> list[tuple[str, int, int, int]]:
    """(corruption, severity, first, end) per chunk of images, the slow corruptions' chunks first."""
    pairs = sorted(pairs, key=lambda cs: -_COST.get(cs[0], 1))
    bounds = [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)]
    return [(c, s, a, b) for c, s in pairs for a, b in bounds]


def _progress_bar(total: int, workers: int) -> Any:
    """A tqdm bar over `total` images (redrawn rarely when stderr is not a terminal, e.g. a log file)."""
    import sys  # noqa: PLC0415

    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(
        total=total, unit="img", desc=f"corrupt ({workers} workers)", smoothing=0.05,
        mininterval=0.2 if sys.stderr.isatty() else 5.0,
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class _Chunks:
    """What a chunk task needs besides its (corruption, severity, first, end): the images, their seed indices,
    the seed and the parameter band."""

    images: np.ndarray
    indices: np.ndarray
    seed: int
    band: str

    def task(self, c: str, s: int, a: int, b: int) -> tuple[np.ndarray, str, int, int, np.ndarray, str]:
        """The argument of :func:`_work` for images ``a:b`` under corruption `c` at severity `s`."""
        return self.images[a:b], c, s, self.seed, self.indices[a:b], self.band


class _SetAssembler:
    """Corrupted chunks written into their set's buffer (allocated on its first chunk); a set is handed out,
    and its buffer released, as soon as its last chunk is in. Memory is thus bounded by the sets in progress."""

    def __init__(self, like: np.ndarray, tasks: list[tuple[str, int, int, int]], bar: Any) -> None:
        self._like = like
        self._pending = Counter((c, s) for c, s, _, _ in tasks)
        self._buffers: dict[tuple[str, int], np.ndarray] = {}
        self._bar = bar

    def add(self, c: str, s: int, a: int, b: int, out: np.ndarray) -> tuple[str, int, np.ndarray] | None:
        """Store images ``a:b`` of set (c, s); the finished set ``(c, s, images)`` if this was its last chunk."""
        buf = self._buffers.get((c, s))
        if buf is None:
            buf = self._buffers[(c, s)] = np.empty_like(self._like)
        buf[a:b] = out
        if self._bar is not None:
            self._bar.update(b - a)
        self._pending[(c, s)] -= 1
        return (c, s, self._buffers.pop((c, s))) if self._pending[(c, s)] == 0 else None


def _run_in_process(
    tasks: list[tuple[str, int, int, int]], chunks: _Chunks, sets: _SetAssembler
) -> Iterator[tuple[str, int, np.ndarray]]:
    """The finished sets, every chunk corrupted in this process, in task order."""
    warm_up()
    for c, s, a, b in tasks:
        done = sets.add(c, s, a, b, _work(chunks.task(c, s, a, b)))
        if done is not None:
            yield done


@contextlib.contextmanager
def _single_threaded_children() -> Iterator[None]:
    """One BLAS / OpenMP thread per spawned worker (they inherit the environment; the workers are the
    parallelism); this process's variables are restored on exit."""
    saved = {k: os.environ.get(k) for k in _SINGLE_THREAD_ENV}
    os.environ.update({k: "1" for k in _SINGLE_THREAD_ENV})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _pool_results(
    pool: ProcessPoolExecutor,
    tasks: list[tuple[str, int, int, int]],
    chunks: _Chunks,
    sets: _SetAssembler,
    workers: int,
) -> Iterator[tuple[str, int, np.ndarray]]:
    """The finished sets as the pool completes their chunks, with at most 2 chunks per worker in flight."""
    queue = iter(tasks)
    in_flight: dict[Any, tuple[str, int, int, int]] = {}

    def submit() -> None:
        while len(in_flight) < 2 * workers:
            task = next(queue, None)
            if task is None:
                return
            in_flight[pool.submit(_work, chunks.task(*task))] = task

    submit()
    while in_flight:
        finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
        for fut in finished:
            c, s, a, b = in_flight.pop(fut)
            done = sets.add(c, s, a, b, fut.result())
            if done is not None:
                yield done
        submit()


def _run_in_pool(
    tasks: list[tuple[str, int, int, int]], chunks: _Chunks, sets: _SetAssembler, workers: int
) -> Iterator[tuple[str, int, np.ndarray]]:
    """The finished sets from `workers` spawned processes (not forked: safe after torch / OpenMP
    initialisation), each loading the frost textures and numba kernels once; the pool ends with the caller."""
    import multiprocessing as mp  # noqa: PLC0415

    warm_up()  # compiles and caches glass_blur's kernel here, once, before the workers load it
    with _single_threaded_children():
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init)
        with _ended_on_error(pool):
            yield from _pool_results(pool, tasks, chunks, sets, workers)


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
    as soon as it is complete (in no fixed order): the corrupted test sets of Hendrycks & Dietterich 2019.

    `images` is uint8 [N, H, W, C]; image i is seeded with ``indices[i]`` (default ``range(N)``; pass the
    images' indices in the full test set so a set's images do not depend on which subset was chosen). Work
    is split into chunks of `chunk_size` images spread over `workers` processes (default: all cores;
    1 = in this process), slow corruptions first; at most 2 chunks per worker are in flight, so memory stays
    bounded by the sets being assembled. Each worker loads the frost textures and the cached numba kernels
    once. The output does not depend on `workers` or `chunk_size`. Workers are spawned (not forked: safe
    after torch / OpenMP initialisation), so a calling script needs ``if __name__ == "__main__":``.
    """
    images = _image_batch(images)
    n = len(images)
    indices = _image_indices(indices, n)
    pairs = _checked_pairs(pairs, band)
    if n == 0 or not pairs:
        return
    band = band or band_for_size(*images.shape[1:3])
    workers = default_workers() if workers is None else max(1, int(workers))
    tasks = _chunk_tasks(pairs, n, max(1, int(chunk_size)))
    chunks = _Chunks(images, indices, seed, band)
    bar = _progress_bar(len(pairs) * n, workers) if progress else None
    sets = _SetAssembler(images, tasks, bar)
    try:
        if workers == 1 or len(tasks) == 1:
            yield from _run_in_process(tasks, chunks, sets)
        else:
            yield from _run_in_pool(tasks, chunks, sets, workers)
    finally:
        if bar is not None:
            bar.close()
