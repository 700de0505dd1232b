"""Uncertainty of the numbers tcnn reports: paired bootstrap over test images, t-intervals over seeds.

Within one run, every model is evaluated on the same test images, so a difference between two models is
estimated with a *paired* bootstrap (Efron & Tibshirani 1993, ch. 13): each replicate draws N test images
with replacement (one draw shared by every model, every corrupted set and the CE baseline), recomputes each
model's metrics on that draw, and takes the difference; the 95% interval is the 2.5th..97.5th percentile of
the replicate differences (percentile method). The unit of resampling is the test image, which carries its
correctness on the clean set and on every corrupted copy of it, so correlations across sets are kept.

Draw scheme (fixed, so a reference implementation can reproduce it): ``rng = numpy.random.default_rng(seed)``;
replicate b takes ``idx = rng.integers(0, N, size=N)`` and uses the image counts ``bincount(idx, N)``.

Across runs (seeds), a configuration's mean carries Student's t-interval: mean +- t_{0.975, n-1} * s / sqrt(n).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

CONFIDENCE = 0.95


def resample_counts(n: int, replicates: int, seed: int, chunk: int = 64) -> Iterator[np.ndarray]:
    """Image counts [b, n] (int32) of the bootstrap draws, ``chunk`` replicates at a time (see the scheme)."""
    if n <= 0 or replicates <= 0:
        raise ValueError(f"resample_counts: need n > 0 and replicates > 0, got {n}, {replicates}")
    rng = np.random.default_rng(seed)
    done = 0
    while done < replicates:
        b = min(chunk, replicates - done)
        counts = np.zeros((b, n), dtype=np.int32)
        for i in range(b):
            counts[i] = np.bincount(rng.integers(0, n, size=n), minlength=n)
        done += b
        yield counts


def percentile_interval(samples: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The percentile interval of bootstrap replicates (NaN replicates ignored; (nan, nan) if all are)."""
    s = np.asarray(samples, dtype=np.float64)
    s = s[np.isfinite(s)]
    if not len(s):
        return float("nan"), float("nan")
    tail = 100 * (1 - confidence) / 2
    lo, hi = np.percentile(s, [tail, 100 - tail])
    return float(lo), float(hi)


def difference(
    point_a: float | None,
    point_b: float | None,
    samples_a: np.ndarray | None,
    samples_b: np.ndarray | None,
    *,
    ratio: bool = False,
    confidence: float = CONFIDENCE,
) -> dict[str, Any] | None:
    """B - A (or B / A - 1 with ``ratio``) with its paired percentile interval: {"diff", "low", "high",
    "excludes_zero"}; None when a point value is missing."""
    if point_a is None or point_b is None or samples_a is None or samples_b is None:
        return None

    def op(a: Any, b: Any) -> Any:
        if not ratio:
            return b - a
        with np.errstate(divide="ignore", invalid="ignore"):
            return b / a - 1.0

    diff = float(op(np.float64(point_a), np.float64(point_b)))
    lo, hi = percentile_interval(
        op(np.asarray(samples_a, np.float64), np.asarray(samples_b, np.float64)), confidence
    )
    return {"diff": diff, "low": lo, "high": hi, "excludes_zero": bool(lo > 0 or hi < 0)}


def bootstrap(
    n: int,
    statistic: Callable[[np.ndarray], Mapping[str, float]],
    *,
    replicates: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """``statistic(counts)`` for every bootstrap draw (counts [n] int: how often each image was drawn),
    as {name: array [replicates]} (NaN where a replicate lacks the name)."""
    rows: list[Mapping[str, float]] = []
    for chunk in resample_counts(n, replicates, seed):
        rows.extend(statistic(c) for c in chunk)
    names = list(dict.fromkeys(k for r in rows for k in r))
    return {k: np.array([r.get(k, np.nan) for r in rows], dtype=np.float64) for k in names}


def t_interval(values: Any, confidence: float = CONFIDENCE) -> dict[str, float | int | None]:
    """Mean of ``values`` (e.g. one metric over seeds) with Student's t-interval (scipy.stats.t):
    {"mean", "low", "high", "n", "std"}; low/high are None for fewer than two finite values."""
    from scipy import stats

    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    v = v[np.isfinite(v)]
    n = len(v)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0, "std": None}
    mean = float(v.mean())
    if n < 2:
        return {"mean": mean, "low": None, "high": None, "n": 1, "std": None}
    sd = float(v.std(ddof=1))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / np.sqrt(n))
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n, "std": sd}
