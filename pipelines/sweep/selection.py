"""Hyperparameters chosen on validation data, the same way for both arms (``sweep.select``).

A hyperparameter that can decide the answer, above all the fine-tuning lr (T-CNN, d'Ascoli et al. 2021,
SM A, Fig. 6: the outcome depends on it), is chosen per arm: for every seed and every configuration of the
grid keys other than ``seed`` and ``sweep.select.over``, the T-CNN takes the ``over`` values of the trial whose
fine-tuned T-CNN has the best validation accuracy, and the control takes those of the trial whose control has
the best validation accuracy. The test split never chooses; ties go to the first trial in grid order.

What attention buys is then T-CNN (its chosen trial) minus control (its chosen trial), per seed with a paired
bootstrap over test images (both models were evaluated on the same clean and corrupted images: the trials of
one seed share the corrupted sets), and over seeds with Student's t-interval (core.robustness.intervals).

Seeds that share a pretrained CNN (``pretrain.seed`` fixed or gridded next to ``seed``, or one imported CNN)
are replicates of the fine-tuning, not independent draws of the whole experiment: the CNN is the unit
(:func:`over_seeds`). With several CNNs the seeds of each CNN are averaged and the t-interval runs over the
CNNs' means (a two-stage, cluster-level analysis); with one CNN the interval runs over its fine-tuning seeds
and the claim is about that CNN.

Written by the sweep driver next to summary.parquet: ``selected.parquet`` (one row per configuration and
seed: the chosen values, both arms' validation and test numbers with percentile intervals, the differences
with paired intervals), ``selected_seeds.parquet`` and ``selected.md`` (the over-seed means and
t-intervals), and parent-run metrics ``selected/<config>/<name>`` (:func:`selection_metrics`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.sweep.tables import write_table
from stages.harness import chain

ARMS = ("tcnn", "control")
SEED = "seed"
#: The pretrained CNN's own seed (core.config PretrainConfig.seed): like ``seed``, a replicate, not a config.
CNN_SEED = "pretrain.seed"
REPLICATES = (SEED, CNN_SEED)
#: The headline metrics of a selected pair (fractions; mCE normalised by the seed's pretrained CNN).
METRICS = ("clean_accuracy", "mca", "mce", "relative_mce")
DIFF = "tcnn_minus_control"


def _config_label(row: dict[str, Any], keys: list[str]) -> str:
    return " ".join(f"{k}={row.get(k)}" for k in keys) or "(base config)"


def choose(
    rows: list[dict[str, Any]], grid_keys: list[str], over: list[str], by: str = "val_accuracy"
) -> list[dict[str, Any]]:
    """The selection itself (pure; ``rows``: summary rows with the grid values and ``<arm>_<by>``).

    Returns one record per (configuration, seed, arm): {"config", "seed", "arm", "trial", the ``over``
    values, "value": the winning validation score, "margin": its lead over the runner-up (None with one
    candidate), "candidates": [(trial, score) ...] in grid order}. Rows without a score (unfinished trials)
    are not candidates."""
    keys = [k for k in grid_keys if k not in REPLICATES and k not in over]
    groups: dict[tuple[str, Any, Any], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((_config_label(r, keys), r.get(SEED), r.get(CNN_SEED)), []).append(r)
    out = []
    for (config, seed, cnn_seed), members in groups.items():
        for arm in ARMS:
            scored = [(m, m.get(f"{arm}_{by}")) for m in members]
            scored = [(m, v) for m, v in scored if v is not None]
            if not scored:
                continue
            best, value = scored[0]
            for m, v in scored[1:]:
                if v > value:
                    best, value = m, v
            rest = [v for m, v in scored if m is not best]
            out.append({
                "config": config, SEED: seed, CNN_SEED: cnn_seed, "arm": arm, "trial": best["trial"],
                **{k: best.get(k) for k in over}, "value": value, "margin": value - max(rest) if rest else None,
                "candidates": json.dumps([[m["trial"], v] for m, v in scored]),
            })  # fmt: skip
    return out


def _read(trial_dir: Path, name: str) -> pa.Table:
    return pq.read_table(trial_dir / chain.output("evaluate", name))


def _models(table: pa.Table, keep: dict[str, str]) -> pa.Table:
    """Rows of the models in ``keep`` (old name -> name in the pair)."""
    col = table.column("model").to_pylist()
    idx = [i for i, m in enumerate(col) if m in keep]
    sub = table.take(pa.array(idx, pa.int64()))
    names = pa.array([keep[m] for m in sub.column("model").to_pylist()], pa.string())
    return sub.set_column(
        sub.schema.get_field_index("model"), "model", names.cast(sub.schema.field("model").type)
    )


def pair_metrics(tcnn_dir: Path, control_dir: Path, *, replicates: int, seed: int) -> dict[str, Any]:
    """The T-CNN of one trial against the control of another (same seed: same pretrained CNN, same test and
    corrupted images): each model's metrics with its percentile interval and T-CNN - control with its paired
    bootstrap interval (core.robustness.paired_bootstrap.bootstrap_metrics; CE normalised by the pretrained CNN)."""
    from core.robustness.baseline import Baseline
    from core.robustness.intervals import difference, percentile_interval
    from core.robustness.metrics import flat_metrics, summarize
    from core.robustness.paired_bootstrap import bootstrap_metrics

    keep_t = {"cnn": "cnn", "tcnn": "tcnn"}
    table = pa.concat_tables([_models(_read(tcnn_dir, "robustness.parquet"), keep_t),
                              _models(_read(control_dir, "robustness.parquet"), {"control": "control"})])  # fmt: skip
    per_image = pa.concat_tables([_models(_read(tcnn_dir, "per_image.parquet"), keep_t),
                                  _models(_read(control_dir, "per_image.parquet"), {"control": "control"})])  # fmt: skip
    base = Baseline.from_table(table, model="cnn", name="cnn")
    points = {m: flat_metrics(summarize(table, base, model=m)) for m in ("cnn", "tcnn", "control")}
    samples = bootstrap_metrics(table, per_image, "cnn", replicates=replicates, seed=seed)
    out: dict[str, Any] = {}
    for m in ("cnn", "tcnn", "control"):
        for k in METRICS:
            if points[m].get(k) is None:
                continue
            lo, hi = percentile_interval(samples[m][k])
            out |= {f"{m}_{k}": points[m][k], f"{m}_{k}_ci_low": lo, f"{m}_{k}_ci_high": hi}
    for k in METRICS:
        d = difference(points["control"].get(k), points["tcnn"].get(k), samples["control"].get(k),
                       samples["tcnn"].get(k))  # fmt: skip
        if d is not None:
            out |= {
                f"{DIFF}_{k}": d["diff"],
                f"{DIFF}_{k}_ci_low": d["low"],
                f"{DIFF}_{k}_ci_high": d["high"],
            }
    return out


def selected_rows(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (configuration, seed) with both arms chosen (see the module docstring); [] when the sweep
    selects nothing (``sweep.select.over`` empty)."""
    from core.utils.hashing import derive_seed

    sel = spec.get("select") or {}
    over = list(sel.get("over") or [])
    if not over:
        return []
    done = [r for r in rows if r["status"] == "finished"]
    picks = choose(done, list(spec["grid"]), over, sel.get("by", "val_accuracy"))
    by_row = {r["trial"]: r for r in done}
    pairs: dict[tuple[str, Any, Any], dict[str, dict[str, Any]]] = {}
    for p in picks:
        pairs.setdefault((p["config"], p[SEED], p[CNN_SEED]), {})[p["arm"]] = p
    out = []
    for (config, seed, _), arms in pairs.items():
        if set(arms) != set(ARMS):
            continue
        t, c = by_row[arms["tcnn"]["trial"]], by_row[arms["control"]["trial"]]
        params = spec["trials"][t["trial"]]["params"]
        row: dict[str, Any] = {"config": config, SEED: seed, "cnn": cnn_unit(t, params)}
        for arm, r in (("tcnn", t), ("control", c)):
            row[f"{arm}_trial"] = r["trial"]
            row |= {f"{arm}_{k}": r.get(k) for k in over}
            row[f"{arm}_val_accuracy"] = r.get(f"{arm}_val_accuracy")
            margin = arms[arm]["margin"]
            n_val = val_images(params, Path(r["trial_dir"]))
            row[f"{arm}_margin_images"] = None if margin is None or not n_val else round(margin * n_val)
            row[f"{arm}_candidates"] = arms[arm]["candidates"]
        row |= pair_metrics(
            Path(t["trial_dir"]), Path(c["trial_dir"]), replicates=int(params["robustness"]["bootstrap"]),
            seed=derive_seed(int(params["seed"]), "bootstrap"),
        )  # fmt: skip
        out.append(row)
    return out


def val_images(params: dict[str, Any], trial_dir: Path, stage: str = "finetune") -> int:
    """The validation images a trial's accuracy is a share of: what its fine-tuning (``stage``: finetune, or
    control for a search's control trial) recorded (``data_roles``, core.data.split_roles: the training split's
    carve-out or the test split's validation half), else data.val_size capped at data.limit.val."""
    try:
        roles = json.loads((trial_dir / chain.metrics_file(stage)).read_text()).get("data_roles") or {}
        return int(roles["val"]["images"])
    except (OSError, ValueError, KeyError, TypeError):
        data = params.get("data") or {}
        n, cap = int(data.get("val_size") or 0), (data.get("limit") or {}).get("val")
        return n if cap is None else min(n, int(cap))


def pooled(
    rows: list[dict[str, Any]], grid_keys: list[str], over: list[str], by: str = "val_accuracy"
) -> list[dict[str, Any]]:
    """Each arm's ``over`` values chosen once for all seeds of a configuration (what a follow-up sweep fixes
    with ``finetune.lr`` and ``finetune.control_lr``): the values with the best validation score averaged
    over the seeds that finished every value, the same rule for both arms. One record per (configuration,
    arm): {"config", "arm", the ``over`` values, "value": the best mean, "margin": its lead over the
    runner-up's mean, "seeds": how many seeds the means average, "means": [(values, mean) ...]}."""
    keys = [k for k in grid_keys if k not in REPLICATES and k not in over]
    out = []
    configs: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        configs.setdefault(_config_label(r, keys), []).append(r)
    for config, members in configs.items():
        for arm in ARMS:
            scores: dict[tuple, dict[tuple, float]] = {}
            for m in members:
                if m.get(f"{arm}_{by}") is not None:
                    unit = (m.get(SEED), m.get(CNN_SEED))
                    scores.setdefault(tuple(m.get(k) for k in over), {})[unit] = m[f"{arm}_{by}"]
            if not scores:
                continue
            units = set.intersection(*(set(v) for v in scores.values()))
            if not units:
                continue
            means = [(vals, sum(v[u] for u in units) / len(units)) for vals, v in scores.items()]
            best_vals, best = max(means, key=lambda t: t[1])  # ties: the first in grid order
            rest = [mean for vals, mean in means if vals != best_vals]
            out.append({"config": config, "arm": arm, **dict(zip(over, best_vals)), "value": best,
                        "margin": best - max(rest) if rest else None, "seeds": len(units),
                        "means": json.dumps([[list(vals), mean] for vals, mean in means])})  # fmt: skip
    return out


SEED_COLUMNS = tuple(f"{m}_{k}" for m in ("tcnn", "control", DIFF) for k in METRICS) + (
    "tcnn_val_accuracy",
    "control_val_accuracy",
)


def cnn_unit(trial_row: dict[str, Any], params: dict[str, Any]) -> str:
    """The pretrained CNN a trial fine-tuned: its shared pretraining's key (one imported CNN has one key for
    every seed), else its CNN seed (`pretrain.seed`, else `seed`)."""
    key = trial_row.get("pretrain_key")
    if key:
        return str(key)
    pre = (params.get("pretrain") or {}).get("seed")
    return f"cnn_seed={params.get(SEED) if pre is None else pre}"


def units(members: list[dict[str, Any]]) -> tuple[list[list[dict[str, Any]]], str]:
    """The members grouped by pretrained CNN, and what the interval runs over: "seeds" (each seed its own
    CNN), "CNNs" (seeds averaged within each of several CNNs) or "seeds of one CNN"."""
    by_cnn: dict[str, list[dict[str, Any]]] = {}
    for i, m in enumerate(members):
        by_cnn.setdefault(str(m.get("cnn") or f"row {i}"), []).append(m)
    clusters = list(by_cnn.values())
    if len(clusters) == len(members):
        return [[m] for m in members], "seeds"
    if len(clusters) == 1:
        return [[m] for m in members], "seeds of one CNN"
    return clusters, "CNNs"


def over_seeds(srows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: the mean of every :data:`SEED_COLUMNS` value with Student's 95% t-interval
    (``<name>_seeds_mean`` / ``_seeds_ci_low`` / ``_seeds_ci_high``), ``n_seeds``, ``n_cnns`` and ``unit``.

    The unit is the pretrained CNN (:func:`units`): where seeds share CNNs, each CNN's seeds are averaged
    first and the interval runs over the CNNs' means, so that fine-tuning replicates of one CNN are not
    counted as independent evidence about CNNs in general; where all seeds share one CNN, the interval runs
    over its seeds and speaks for that CNN."""
    from core.robustness.intervals import t_interval

    groups: dict[str, list[dict[str, Any]]] = {}
    for r in srows:
        groups.setdefault(r["config"], []).append(r)
    out = []
    for config, members in groups.items():
        clusters, unit = units(members)
        n_cnns = 1 if unit == "seeds of one CNN" else len(clusters)
        row: dict[str, Any] = {"config": config, "n_seeds": len(members), "n_cnns": n_cnns, "unit": unit,
                               "seeds": json.dumps(sorted(m[SEED] for m in members))}  # fmt: skip
        for name in SEED_COLUMNS:
            ci = t_interval([mean_of([m.get(name) for m in c]) for c in clusters])
            row |= {f"{name}_seeds_mean": ci["mean"], f"{name}_seeds_ci_low": ci["low"],
                    f"{name}_seeds_ci_high": ci["high"]}  # fmt: skip
        out.append(row)
    return out


def mean_of(values: list[Any]) -> float | None:
    """The mean of the values that are not None (None: there are none)."""
    v = [float(x) for x in values if x is not None]
    return sum(v) / len(v) if v else None


def selection_metrics(srows: list[dict[str, Any]], agg: list[dict[str, Any]]) -> dict[str, float]:
    """Parent-run metrics: ``selected/<config>/seed<k>/<name>`` per seed (interval ends included) and
    ``selected/<config>/<name>_seeds_{mean,ci_low,ci_high}`` over seeds."""
    out: dict[str, float] = {}

    def label(config: str) -> str:
        return re.sub(r"[^A-Za-z0-9_.\-/ ]+", "_", config).replace(" ", "/")

    for r in srows:
        for k, v in r.items():
            if (
                isinstance(v, int | float)
                and not isinstance(v, bool)
                and k != SEED
                and k.startswith(("tcnn", "control", "cnn"))
            ):
                out[f"selected/{label(r['config'])}/seed{r[SEED]}/{k}"] = float(v)
    for a in agg:
        for k, v in a.items():
            if k.endswith(("_seeds_mean", "_seeds_ci_low", "_seeds_ci_high")) and isinstance(v, int | float):
                out[f"selected/{label(a['config'])}/{k}"] = float(v)
    return out


def _pp(v: float | None, sign: bool = False) -> str:
    return "-" if v is None else f"{100 * v:{'+' if sign else ''}.2f}"


def verdict(
    mean: float | None, low: float | None, high: float | None, *, lower_is_better: bool = False
) -> str:
    """The sentence next to an interval: which arm is better, or that the interval includes 0."""
    if mean is None or low is None or high is None:
        return "too few seeds for an interval"
    if low <= 0 <= high:
        return "no difference resolved (the interval includes 0)"
    tcnn_better = (high < 0) if lower_is_better else (low > 0)
    return "the T-CNN is better" if tcnn_better else "the control is better"


def _images(n: Any) -> str:
    return "-" if n is None else f"{n:,}"


def pooled_markdown(pool: list[dict[str, Any]], over: list[str]) -> str:
    """The pooled choice (:func:`pooled`) as sentences: per configuration and arm, the values, their mean
    validation accuracy over how many seeds, and the lead over the runner-up."""
    text = (
        "\nPooled over seeds (each arm's values by mean validation accuracy; what a follow-up sweep fixes):\n"
    )
    for p in pool:
        vals = ", ".join(f"{k}={p.get(k)}" for k in over)
        lead = "" if p["margin"] is None else f", {100 * p['margin']:.2f} pp ahead of the runner-up"
        text += f"- {p['config']}, {p['arm']}: {vals} (mean {100 * p['value']:.2f}% over {p['seeds']} seeds{lead}).\n"
    return text


def markdown(
    srows: list[dict[str, Any]],
    agg: list[dict[str, Any]],
    over: list[str],
    notes: list[str] | None = None,
    pool: list[dict[str, Any]] | None = None,
) -> str:
    """Per seed and over seeds: the chosen values and T-CNN - control at them, with intervals; ``notes``:
    what bracketing added and why (pipelines/sweep/bracket.py)."""
    keys = ", ".join(over)
    text = _selected_table(srows, agg, over) + "\n\n"
    text += (
        f"Each arm at the {keys} with the best validation accuracy for its seed (the test split only reports). "
        "Per seed: paired bootstrap 95% interval over test images; mean row: Student's 95% t-interval over "
        "its unit (seeds; or the CNNs, each the mean of its seeds, where seeds share a pretrained CNN; or the "
        "seeds of one CNN, a claim about that CNN). mCE is normalised by the seed's pretrained CNN "
        "(lower is better).\n"
    )
    for a in agg:
        for m, low_better in (("clean_accuracy", False), ("mca", False), ("mce", True)):
            mean, lo, hi = (a.get(f"{DIFF}_{m}_seeds{e}") for e in ("_mean", "_ci_low", "_ci_high"))
            text += f"- {a['config']}, {m}: {verdict(mean, lo, hi, lower_is_better=low_better)}.\n"
    if pool:
        text += pooled_markdown(pool, over)
    if notes:
        text += "\nBracketing (the grid grown until each choice is interior):\n" + "".join(
            f"- {n}\n" for n in notes
        )
    return text


def _selected_table(srows: list[dict[str, Any]], agg: list[dict[str, Any]], over: list[str]) -> str:
    """The table of :func:`markdown`: one row per (configuration, seed), then each configuration's mean row
    (its differences in bold)."""
    keys = ", ".join(over)
    lines = [
        f"| config | seed | T-CNN {keys} | control {keys} | T-CNN val / test | control val / test "
        "| T-CNN - control clean (pp) | mCA T-CNN / control | T-CNN - control mCA (pp) | T-CNN - control mCE (pp) "
        "| won by (val images) T-CNN / control |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in srows:
        lines.append(
            f"| {r['config']} | {r[SEED]} | {', '.join(str(r.get(f'tcnn_{k}')) for k in over)} "
            f"| {', '.join(str(r.get(f'control_{k}')) for k in over)} "
            f"| {_pp(r.get('tcnn_val_accuracy'))} / {_pp(r.get('tcnn_clean_accuracy'))} "
            f"| {_pp(r.get('control_val_accuracy'))} / {_pp(r.get('control_clean_accuracy'))} "
            f"| {_diff_cell(r, 'clean_accuracy')} | {_pp(r.get('tcnn_mca'))} / {_pp(r.get('control_mca'))} "
            f"| {_diff_cell(r, 'mca')} | {_diff_cell(r, 'mce')} "
            f"| {_images(r.get('tcnn_margin_images'))} / {_images(r.get('control_margin_images'))} |"
        )
    for a in agg:
        lines.append(
            f"| {a['config']} | {mean_label(a)} | | "
            f"| {_pp(a.get('tcnn_val_accuracy_seeds_mean'))} / {_pp(a.get('tcnn_clean_accuracy_seeds_mean'))} "
            f"| {_pp(a.get('control_val_accuracy_seeds_mean'))} / {_pp(a.get('control_clean_accuracy_seeds_mean'))} "
            f"| **{_diff_cell(a, 'clean_accuracy', '_seeds')}** "
            f"| {_pp(a.get('tcnn_mca_seeds_mean'))} / {_pp(a.get('control_mca_seeds_mean'))} "
            f"| **{_diff_cell(a, 'mca', '_seeds')}** | **{_diff_cell(a, 'mce', '_seeds')}** | |"
        )
    return "\n".join(lines)


def _diff_cell(r: dict[str, Any], m: str, suffix: str = "") -> str:
    """T-CNN - control in metric ``m`` with its interval, in pp: a seed's row (``suffix`` "") or the mean
    over seeds (``suffix`` "_seeds")."""
    mean, lo, hi = (
        r.get(f"{DIFF}_{m}{suffix}{e}")
        for e in (("", "_ci_low", "_ci_high") if not suffix else ("_mean", "_ci_low", "_ci_high"))
    )
    return f"{_pp(mean, True)} [{_pp(lo, True)}, {_pp(hi, True)}]"


def mean_label(a: dict[str, Any]) -> str:
    """The mean row's label: how many seeds, and over what the interval runs."""
    unit = a.get("unit", "seeds")
    if unit == "CNNs":
        return f"mean of {a['n_cnns']} CNNs ({a['n_seeds']} seeds; t over CNNs)"
    if unit == "seeds of one CNN":
        return f"mean of {a['n_seeds']} seeds of one CNN"
    return f"mean of {a['n_seeds']}"


def write(
    srows: list[dict[str, Any]],
    agg: list[dict[str, Any]],
    over: list[str],
    sweep_dir: Path,
    notes: list[str] | None = None,
    pool: list[dict[str, Any]] | None = None,
) -> list[Path]:
    """``selected.parquet``, ``selected_seeds.parquet``, ``selected_pooled.parquet`` and ``selected.md``
    (atomic)."""
    from core.utils.atomic import atomic_write

    text = markdown(srows, agg, over, notes, pool)
    return [
        write_table(srows, sweep_dir / "selected.parquet"),
        write_table(agg, sweep_dir / "selected_seeds.parquet"),
        write_table(pool or [], sweep_dir / "selected_pooled.parquet"),
        atomic_write(sweep_dir / "selected.md", lambda fh: fh.write(text.encode())),
    ]
