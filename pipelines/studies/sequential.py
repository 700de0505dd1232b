"""How many main seeds a study runs: a sequential rule stated before the run, and its coverage (issue 57, item 2).

The rule (:func:`decide`): run ``first`` seeds (3); after each finished seed, stop once Student's 95% half-width
``t_{0.975, n-1} s_n / sqrt(n)`` of *every* sized difference (T-CNN - control clean accuracy and mCA) is at most
the target (0.5 pp), or once ``cap`` seeds have run; otherwise run one more seed. The answer is then the
ordinary Student's 95% interval over the ``n`` seeds run.

Stopping when the sample SD happens to be small makes that interval slightly too short on average: the
fixed-width sequential intervals of Chow & Robbins (1965, "On the asymptotic theory of fixed-width sequential
confidence intervals for the mean") reach their nominal coverage only as the width goes to zero; Stein's two-
stage procedure (Stein 1945) is exact but asks for ``(t_{0.975, 2} s_3 / 0.5 pp)^2`` seeds, 2.5x the fixed-n
count at n = 3. The effect of this rule is therefore measured (:func:`coverage`, a Monte-Carlo simulation of
the whole rule on normal per-seed differences, two metrics with correlation ``rho``) and stated next to the
answer; ``python -m pipelines.studies.sequential`` prints the table docs/studies.md holds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

TARGET = 0.005  # the 95% half-width asked for (fractions: 0.5 pp)
FIRST, CAP = 3, 10  # seeds run before the rule is first applied; seeds at most
CONFIDENCE = 0.95


def half_width(values: Sequence[float], confidence: float = CONFIDENCE) -> float:
    """Student's ``confidence`` half-width of the mean of ``values`` (scipy.stats.t); inf for fewer than 2."""
    from scipy import stats

    n = len(values)
    if n < 2:
        return math.inf
    return float(stats.t.ppf(0.5 + confidence / 2, n - 1) * np.std(values, ddof=1) / math.sqrt(n))


def decide(diffs: dict[str, Sequence[float]], *, target: float = TARGET, first: int = FIRST,
           cap: int = CAP) -> dict[str, Any]:  # fmt: skip
    """The rule, applied to the per-seed differences finished so far (one list per sized metric, in seed order).

    Returns ``{"n": seeds so far, "run": seeds to run next (0: stop), "reason": why, "half_width": per metric}``.
    """
    ns = {len(v) for v in diffs.values()}
    if len(ns) != 1:
        raise ValueError(f"every metric needs the same seeds; got {ns}")
    (n,) = ns
    widths = {k: half_width(list(v)) for k, v in diffs.items()}
    if n < first:
        return {"n": n, "run": first - n, "reason": f"the first {first} seeds", "half_width": widths}
    if all(w <= target + 1e-12 for w in widths.values()):
        return {"n": n, "run": 0, "reason": f"every half-width <= {100 * target:g} pp", "half_width": widths}
    if n >= cap:
        return {"n": n, "run": 0, "reason": f"the cap of {cap} seeds", "half_width": widths}
    return {"n": n, "run": 1, "reason": f"a half-width > {100 * target:g} pp", "half_width": widths}


def simulate(sd: float, *, rho: float = 0.5, target: float = TARGET, first: int = FIRST, cap: int = CAP,
             reps: int = 20_000, seed: int = 0) -> dict[str, float]:  # fmt: skip
    """Monte-Carlo of the whole rule: per-seed differences ~ N(0, sd^2) on two metrics of correlation ``rho``
    (both with the same SD; the first is the one whose coverage is counted). Returns the coverage of the final
    95% t-interval of the first metric, its Monte-Carlo standard error, the mean seeds run and how often the
    cap was reached. Vectorised over replicates: every replicate draws ``cap`` seeds, the rule reads a prefix."""
    from scipy import stats

    rng = np.random.default_rng(seed)
    z = rng.standard_normal((reps, cap, 2))
    x = sd * z[..., 0]
    y = sd * (rho * z[..., 0] + math.sqrt(1 - rho**2) * z[..., 1])
    stop = np.full(reps, cap)
    open_ = np.ones(reps, dtype=bool)
    widths_at = {}
    for n in range(max(first, 2), cap + 1):
        t = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) / math.sqrt(n)
        wx, wy = t * x[:, :n].std(axis=1, ddof=1), t * y[:, :n].std(axis=1, ddof=1)
        widths_at[n] = wx
        done = open_ & (wx <= target) & (wy <= target)
        stop[done] = n
        open_ &= ~done
    idx = np.arange(reps)
    means = np.cumsum(x, axis=1)[idx, stop - 1] / stop
    hw = np.stack([widths_at[n] for n in range(max(first, 2), cap + 1)], axis=1)[idx, stop - max(first, 2)]
    covered = np.abs(means) <= hw
    p = float(covered.mean())
    return {"sd": sd, "coverage": p, "mc_se": math.sqrt(p * (1 - p) / reps), "mean_seeds": float(stop.mean()),
            "at_cap": float(np.mean((stop == cap) & (hw > target)))}  # fmt: skip


SDS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.007, 0.01, 0.015)  # per-seed SDs of a difference (fractions)


def table(sds: Sequence[float] = SDS, **kw: Any) -> str:
    """The rule's coverage and seeds over a range of true SDs, as the markdown docs/studies.md holds."""
    lines = ["| true SD of T-CNN - control (pp) | coverage of the 95% interval | MC s.e. | mean seeds run | "
             "ends at the cap, wider than 0.5 pp |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for sd in sds:
        r = simulate(sd, **kw)
        lines.append(f"| {100 * sd:.1f} | {100 * r['coverage']:.1f}% | {100 * r['mc_se']:.1f} pp "
                     f"| {r['mean_seeds']:.1f} | {100 * r['at_cap']:.0f}% |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    if sys.argv[1:] if argv is None else argv:
        print(
            "usage: python -m pipelines.studies.sequential   (prints the rule's coverage table)",
            file=sys.stderr,
        )
        return 2
    print(f"rule: {FIRST} seeds, then one at a time until every 95% half-width <= {100 * TARGET:g} pp, "
          f"at most {CAP}; two metrics, correlation 0.5, 20,000 replicates each, seed 0\n")  # fmt: skip
    print(table(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
