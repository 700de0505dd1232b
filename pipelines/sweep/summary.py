"""The sweep's summary table (Parquet) and plots, built from the trials' own output files.

One row per trial: the grid values (one column per grid key, named by its dotted key), the effective
epochs (after fraction scaling), clean accuracy of the CNN and the T-CNN, mean corruption accuracy (mCA),
mCE and relative mCE ([TCNN21] Sec. 4 / Hendrycks & Dietterich; the CNN of the trial is the baseline by default,
so its mCE is 1), the reparameterization's equivalence error (max |logit diff|), the trial's status,
directory and MLflow run id, and where it ran: ``node`` (the node of the attempt that finished it),
``attempts``, ``attempt_nodes`` (every attempt's node, in order) and ``worker_nodes`` (the nodes the
data-parallel stage runs of the trial, its own and the shared ones, had ranks on; [] with one worker).

Plots: `core.viz.sweep_plots` (each only when the grid varies what it shows).

Model-kind comparisons (issue 8): :func:`kind_rows` re-normalises every trial's corruption errors by ONE
baseline, the pretrained CNN of the first finished ``kind=cnn`` trial, because a trial's own mCE is relative
to its own pretrained model (a ConViT or AA-ResNet trial pretrains its own network), which would put the
kinds on different scales. Written as ``kinds.parquet`` and ``kinds.md`` and logged on the parent run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from core.utils.atomic import atomic_write
from pipelines.sweep.bracket import round_of
from pipelines.sweep.plan import SHORT
from pipelines.sweep.selection import REPLICATES, mean_label, mean_of, units
from pipelines.sweep.tables import write_table
from pipelines.sweep.trial_metrics import HEADLINE
from stages.harness import chain

METRIC_COLUMNS = HEADLINE  # the numbers every trial reports last
SEED = "seed"
#: Column suffixes of a seed aggregate: mean over seeds and Student's 95% t-interval. Not "_ci_low" alone:
#: summary.parquet holds each trial's own bootstrap interval under ``<metric>_ci_low`` / ``_ci_high``.
SEED_SUFFIXES = ("_seeds_mean", "_seeds_ci_low", "_seeds_ci_high")
#: The metrics aggregated over seeds (mean and t-interval per configuration): each model's headline numbers
#: and what attention buys (T-CNN - control) and the T-CNN vs the pretrained CNN.
SEED_METRICS = tuple(
    [f"{m}_{k}" for m in ("cnn", "control", "tcnn") for k in ("clean_accuracy", "mca", "mce", "relative_mce")]
    + [
        f"{d}_{k}"
        for d in ("tcnn_minus_control", "tcnn_minus_cnn")
        for k in ("clean_accuracy", "mca", "mce", "relative_mce")
    ]
)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def summary_rows(spec: dict[str, Any], status: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One dict per trial (grid order) from the files under ``<sweep>/trials/<tid>/``."""
    status = status or {}
    rounds = round_of(spec) if spec.get("bracket") or spec.get("bracket_rounds") else None
    rows = []
    for tid, t in spec["trials"].items():
        root = Path(spec["sweep_dir"]) / "trials" / tid
        done = _json(root / "done.json")
        refused = _json(root / "refused.json") or {}  # pipelines.sweep.replay.REFUSED
        eq = _json(root / chain.metrics_file("reparam")) or {}
        p = t["params"]
        row: dict[str, Any] = {"trial": tid}
        for key in spec["grid"]:
            row[key] = t["overrides"].get(key)
        if rounds is not None:
            row["bracket_round"] = rounds[tid]  # 0: the asked grid; k: added by bracketing round k
        row.update(
            {
                "pretrain_epochs": p["pretrain"]["epochs"],
                "t1": p["reparam"]["epoch"],
                "finetune_epochs": p["finetune"]["epochs"],
                "model_kind": p["model"]["kind"],
                "status": "finished" if done else "refused" if refused else status.get(tid, "missing"),
            }
        )
        row["refused"] = refused.get("refused")  # the refusing stage and its one line
        head = (done or {}).get("headline", {})
        for col in METRIC_COLUMNS:
            value = head.get(col)
            row[col] = float(value) if value is not None else None
        if row["equivalence_error"] is None:
            row["equivalence_error"] = eq.get("max_abs_logit_diff")
        row["pretrain_key"] = t["pretrain_key"] if spec.get("share_pretraining", True) else None
        row["trial_dir"] = str(root)
        state = _json(root / "trial.json") or {}
        row["mlflow_run_id"] = (done or {}).get("mlflow_run_id") or state.get("mlflow_run_id")
        row.update(_placement(done or {}, state))
        rows.append(row)
    return rows


def cnn_evaluation_reason(row: dict[str, Any]) -> str | None:
    """Why a trial evaluated the pretrained CNN again instead of reading the shared evaluation (a damaged store,
    a check that disagreed: stages.cnn_evaluation), from its evaluate metrics; None when it did not."""
    metrics = _json(Path(row["trial_dir"]) / chain.metrics_file("evaluate")) or {}
    return (metrics.get("cnn_evaluation") or {}).get("reason")


def _placement(done: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Where a trial ran, from its done.json (finished) or trial.json (its attempts so far)."""
    nodes = list(state.get("nodes") or done.get("attempt_nodes") or [])
    return {
        "node": done.get("node") or (nodes[-1] if nodes else None),
        "attempts": state.get("attempts"),
        "attempt_nodes": nodes,
        "worker_nodes": list(done.get("worker_nodes") or []),
    }


# ------------------------------------------------------------------------------------------ seeds


def config_label(row: dict[str, Any], keys: list[str]) -> str:
    """The configuration of a trial without its seed, in short form (``stride_mode=s1 alpha=0.5``)."""
    return " ".join(f"{SHORT.get(k, k)}={json.dumps(row.get(k)) if isinstance(row.get(k), dict | list) else row.get(k)}"
                    for k in keys) or "(base config)"  # fmt: skip


def seed_rows(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """When the grid varies ``seed``: one row per configuration (the other grid keys) with, for every
    :data:`SEED_METRICS` name, the mean over its finished seeds and Student's 95% t-interval
    (``<metric>`` + :data:`SEED_SUFFIXES`; core.robustness.intervals.t_interval), ``n_seeds``, ``n_cnns`` and
    ``unit``: where seeds share a pretrained CNN (`pretrain.seed`), the CNN is the unit, as in the selection
    (`pipelines.sweep.selection.units`). [] otherwise."""
    from core.robustness.intervals import t_interval

    if SEED not in spec["grid"]:
        return []
    keys = _config_keys(spec)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in _finished(rows):
        groups.setdefault(config_label(r, keys), []).append(r)
    out = []
    for label, members in groups.items():
        row: dict[str, Any] = {"config": label, **{k: members[0].get(k) for k in keys}}
        cnns = [{**m, "cnn": m.get("pretrain_key") or f"cnn_seed={m.get('pretrain.seed', m.get(SEED))}"}
                for m in members]  # fmt: skip
        clusters, unit = units(cnns)
        n_cnns = 1 if unit == "seeds of one CNN" else len(clusters)
        row["n_seeds"], row["n_cnns"], row["unit"] = len(members), n_cnns, unit
        row["seeds"] = json.dumps(sorted(m.get(SEED) for m in members))
        for metric in SEED_METRICS:
            ci = t_interval([mean_of([m.get(metric) for m in c]) for c in clusters])
            row |= {metric + end: ci[k] for end, k in zip(SEED_SUFFIXES, ("mean", "low", "high"))}
        out.append(row)
    return out


def _config_keys(spec: dict[str, Any]) -> list[str]:
    """The grid keys that make a configuration: all but the replicates (``seed``, ``pretrain.seed``)."""
    return [k for k in spec["grid"] if k not in REPLICATES]


def with_seed_columns(
    rows: list[dict[str, Any]], srows: list[dict[str, Any]], spec: dict[str, Any]
) -> list[dict[str, Any]]:
    """The per-trial rows with their configuration's seed aggregate appended (``config`` and the
    ``<metric>_seeds_mean`` / ``_seeds_ci_low`` / ``_seeds_ci_high`` columns of :func:`seed_rows`), for
    summary.parquet."""
    if not srows:
        return rows
    keys = _config_keys(spec)
    by = {s["config"]: s for s in srows}
    out = []
    for r in rows:
        agg = by.get(config_label(r, keys), {})
        extra = {k: v for k, v in agg.items() if k == "config" or k == "n_seeds" or k.endswith(SEED_SUFFIXES)}
        out.append({**r, "config": config_label(r, keys), **extra})
    return out


def write_seeds(srows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    """``seeds.parquet`` (one row per configuration) and ``seeds.md`` in the sweep directory (atomic)."""
    text = seeds_markdown(srows)
    return [
        write_table(srows, sweep_dir / "seeds.parquet"),
        atomic_write(sweep_dir / "seeds.md", lambda fh: fh.write(text.encode())),
    ]


def seed_metrics(srows: list[dict[str, Any]]) -> dict[str, float]:
    """The seed aggregates as parent-run metrics: ``seeds/<config>/<metric>_seeds_{mean,ci_low,ci_high}``."""
    import re

    out: dict[str, float] = {}
    for s in srows:
        label = re.sub(r"[^A-Za-z0-9_.\-/ ]+", "_", s["config"]).replace(" ", "/")
        for k, v in s.items():
            if k.endswith(SEED_SUFFIXES) and isinstance(v, int | float):
                out[f"seeds/{label}/{k}"] = float(v)
    return out


def seeds_markdown(srows: list[dict[str, Any]]) -> str:
    """The seed aggregate as a Markdown table: mean [95% t-interval] in % (differences in pp)."""

    def cell(s: dict[str, Any], m: str) -> str:
        mean, lo, hi = (s.get(m + end) for end in SEED_SUFFIXES)
        if mean is None:
            return "-"
        sign = "+" if "_minus_" in m else ""
        return f"{100 * mean:{sign}.2f}" + (
            f" [{100 * lo:{sign}.2f}, {100 * hi:{sign}.2f}]" if lo is not None else ""
        )

    cols = ["tcnn_clean_accuracy", "control_clean_accuracy", "tcnn_minus_control_clean_accuracy", "tcnn_mca",
            "control_mca", "tcnn_minus_control_mca", "tcnn_minus_control_mce", "tcnn_minus_cnn_mce"]  # fmt: skip
    lines = ["| config | seeds | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
    for s in srows:
        label = mean_label(s).removeprefix("mean of ")
        lines.append(f"| {s['config']} | {label} | " + " | ".join(cell(s, c) for c in cols) + " |")
    return (
        "\n".join(lines)
        + "\n\nMean over seeds [95% t-interval over seeds; where seeds share a pretrained CNN, over the CNNs' "
        "means], in %; `_minus_` columns are differences in pp.\n"
    )


# ----------------------------------------------------------------------------------------------- plots


def _finished(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["status"] == "finished"]


def make_plots(
    spec: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path, krows: list[dict[str, Any]] | None = None
) -> list[Path]:
    """The plots the grid supports (`core.viz.sweep_plots`); returns the files written. ``krows``: the sweep's
    :func:`kind_rows` when the caller has them already (they read every trial's robustness table)."""
    from core.viz.sweep_plots import sweep_plots

    finished = _finished(rows)
    if krows is None:
        krows = kind_rows(spec, finished) if finished else []
    return sweep_plots(
        spec["name"], spec["grid"], finished, krows, out_dir, fraction_scales_epochs=_scales(spec)
    )


# ------------------------------------------------------------------------------------- kind comparison
def _kinds(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["model_kind"] for r in rows if r.get("model_kind")))


def kind_rows(spec: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per finished trial when the sweep compares model kinds (else []), plus the common baseline:
    kind, arch, grid label, clean accuracy, mCA, and mCE / relative mCE of the trial's final model against the
    pretrained CNN of the first finished ``kind=cnn`` trial (see the module docstring). Without a cnn trial,
    mCE columns are the trials' own (each against its own pretrained model) and ``baseline`` says so."""
    from core.robustness.baseline import Baseline
    from core.robustness.metrics import summarize

    done = _finished(rows)
    if len(_kinds(done)) < 2:
        return []

    def table(r: dict[str, Any]) -> Any:
        path = Path(r["trial_dir"]) / chain.output("evaluate", "robustness.parquet")
        return pq.read_table(path) if path.is_file() else None

    ref = next((r for r in done if r["model_kind"] == "cnn" and table(r) is not None), None)
    base = Baseline.from_table(table(ref), model="cnn", name="cnn") if ref else None
    out: list[dict[str, Any]] = []
    if ref is not None:
        s = summarize(table(ref), base, model="cnn")
        arch = spec["trials"][ref["trial"]]["params"]["model"]["arch"]
        out.append(_kind_row("cnn (pretrained, baseline)", arch, ref, s, f"pretrained CNN of {ref['trial']}"))
    for r in done:
        t = table(r)
        if t is None:
            continue
        own = base if base is not None else Baseline.from_table(t, model="cnn")
        s = summarize(t, own, model="tcnn")
        arch = spec["trials"][r["trial"]]["params"]["model"]["arch"]
        why = f"pretrained CNN of {ref['trial']}" if ref else "the trial's own pretrained model"
        out.append(_kind_row(r["model_kind"], arch, r, s, why))
    return out


def _kind_row(kind: str, arch: str, r: dict[str, Any], s: dict[str, Any], baseline: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "arch": arch,
        "trial": r["trial"],
        "clean_accuracy": s.get("clean_accuracy"),
        "mca": s.get("mca"),
        "mce": s.get("mce"),
        "relative_mce": s.get("relative_mce"),
        "baseline": baseline,
        "mlflow_run_id": r.get("mlflow_run_id"),
    }


def kind_metrics(krows: list[dict[str, Any]]) -> dict[str, float]:
    """The kind comparison as parent-run metrics, side by side in MLflow's compare view and charts:
    ``kind_<kind>_{clean_accuracy,mca,mce}`` (``kind_<kind>_<arch>_...`` where a kind comes with several archs)
    and ``kind_baseline_...`` for the common CE baseline. Prefixed so they never read as the per-trial
    ``cnn_*`` / ``tcnn_*`` metrics (pretrained CNN / fine-tuned model of one trial)."""
    counts: dict[str, int] = {}
    for k in krows:
        counts[k["kind"]] = counts.get(k["kind"], 0) + 1
    out: dict[str, float] = {}
    for k in krows:
        if k["kind"].startswith("cnn ("):
            name = "baseline"
        else:
            name = k["kind"] if counts[k["kind"]] == 1 else f"{k['kind']}_{k['arch']}"
        for col in ("clean_accuracy", "mca", "mce"):
            if k[col] is not None:
                out[f"kind_{name}_{col}"] = k[col]
    return out


def kinds_markdown(krows: list[dict[str, Any]]) -> str:
    """The comparison as a Markdown table (percentages; mCE as in Hendrycks & Dietterich, x100)."""

    def pct(v: Any) -> str:
        return "-" if v is None else f"{100 * v:.2f}"

    lines = [
        "| kind | arch | clean acc. (%) | mCA (%) | mCE (%) | relative mCE (%) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for k in krows:
        lines.append(
            f"| {k['kind']} | {k['arch']} | {pct(k['clean_accuracy'])} | {pct(k['mca'])} | {pct(k['mce'])} "
            f"| {pct(k['relative_mce'])} |"
        )
    base = krows[0]["baseline"] if krows else ""
    return "\n".join(lines) + f"\n\nCE normalised by: {base}.\n"


def write_kinds(krows: list[dict[str, Any]], sweep_dir: Path) -> list[Path]:
    """``kinds.parquet`` and ``kinds.md`` in the sweep directory (atomic)."""
    text = kinds_markdown(krows)
    return [
        write_table(krows, sweep_dir / "kinds.parquet"),
        atomic_write(sweep_dir / "kinds.md", lambda fh: fh.write(text.encode())),
    ]


def _scales(spec: dict[str, Any]) -> bool:
    return bool(spec.get("base", {}).get("data", {}).get("fraction_scales_epochs", True))


def format_table(rows: list[dict[str, Any]], grid_keys: list[str]) -> str:
    """A compact text table for the terminal (clean accuracies, T-CNN - control, T-CNN mCA / mCE)."""
    cols = ("cnn_clean_accuracy", "control_clean_accuracy", "tcnn_clean_accuracy",
            "tcnn_minus_control_clean_accuracy", "tcnn_mca", "tcnn_mce")  # fmt: skip
    head = ["trial", *grid_keys, "status", "cnn", "control", "tcnn", "tcnn-control", "tcnn_mca", "tcnn_mce"]
    lines = [head]

    def f(v: Any) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    for r in rows:
        lines.append(
            [r["trial"], *(f(r.get(k)) for k in grid_keys), r["status"]] + [f(r.get(k)) for k in cols]
        )
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in lines)
