"""`tcnn study run`: a powered T-CNN vs control answer in one resumable command (issue 48, item 4).

    tcnn study run PARAMS --name NAME --out DIR [--readme README.md] [--max-seeds N] [--dry-run] [-S k=v ...]

The steps, each a sweep or a pure function of finished sweeps, so that running the command again continues
where it stopped (a sweep resumes with its finished trials kept) and rewrites the same outputs:

1. **Pilot** (sweep ``NAME-pilot``, the params as given): a grid over ``seed`` x ``finetune.lr``, bracketed
   until each arm's choice is interior (``sweep.select: {over: [finetune.lr], bracket: ...}``).
2. **Choice**: each arm's lr pooled over the pilot seeds by mean validation accuracy
   (``selected_pooled.parquet``, :func:`pipelines.sweep.selection.pooled`, the same rule for both arms);
   interior = strictly between the smallest and the largest lr the pilot ran.
3. **Power arithmetic**: the pilot seeds' T-CNN - control differences at those lrs (T-CNN at its lr, control
   at its own, as the main phase measures them) give the between-seed SD; the main phase gets the smallest n
   with t(0.975, n-1) SD / sqrt(n) <= 0.5 pp on clean accuracy and on mCA (:mod:`pipelines.studies.sizing`;
   an internal pilot, Wittes & Brittain 1990), at least 2 and at most ``--max-seeds``.
4. **Main** (sweep ``NAME-main``): n fresh seeds (after the pilot's), each arm at its pooled lr
   (``finetune.lr`` / ``finetune.control_lr``); the answer is the main seeds' mean difference with Student's
   95% interval (the sweep's ``seeds.parquet``), so the lr was chosen on seeds the answer does not use.
5. **Export**: ``DIR/study.json`` (every figure above), ``DIR/pilot.csv`` and ``DIR/main.csv`` (per seed),
   ``DIR/study.md`` (the block), and with ``--readme`` the block between ``<!-- study:NAME:begin/end -->``.

``--dry-run`` runs the same steps at a smoke size (:data:`DRY_RUN`: capped splits, one epoch, one corrupted
set, at most 2 pilot seeds and 2 main seeds) on the CPU: it checks the chain, it answers nothing.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json, atomic_write_text
from pipelines.studies.results import write_csv
from pipelines.studies.sizing import TARGET, half_width, seeds_needed
from pipelines.sweep.plan import SweepError
from pipelines.sweep.selection import mean_of

KEY = "finetune.lr"
STATE = "study.json"
ARMS = ("tcnn", "control")
MODELS = ("cnn", "control", "tcnn")  # the imported or pretrained CNN, its fine-tuned control, its T-CNN
#: The differences sized and reported: summary.parquet's per-arm columns (fractions) and their names.
SIZED = (("clean_accuracy", "clean accuracy"), ("mca", "mCA"))
#: --dry-run: the smoke size (data.limit caps each split; a capped run answers nothing).
DRY_RUN = [
    "data.limit={train: 256, val: 128, test: 128}",
    "finetune.epochs=1",
    "finetune.stop=null",
    "robustness.n_images=32",
    "robustness.corruptions=[gaussian_noise]",
    "robustness.severities=[1]",
    "robustness.bootstrap=50",
]
DRY_RUN_SEEDS = 2


class StudyRunError(SweepError):
    """A study that cannot run as asked: one line, exit 2."""


def pilot_overrides(params: Any, dry_run: bool) -> list[str]:
    """On a dry run, the pilot's grid cut to its first 2 seeds (the smoke size, :data:`DRY_RUN`, goes first)."""
    if not dry_run:
        return []
    grid = dict(params.sweep.grid)
    seeds, lrs = list(grid.get("seed", []))[:DRY_RUN_SEEDS], list(grid.get(KEY, []))
    return [f"sweep.grid={{seed: {json.dumps(seeds)}, {KEY}: {json.dumps(lrs)}}}"]


def check_pilot(params: Any) -> None:
    """The pilot design this command runs: a grid of ``seed`` (2 or more) x ``finetune.lr`` (2 or more) and
    nothing else, with the lr selected on validation data."""
    grid, sel = params.sweep.grid, params.sweep.select
    if set(grid) != {"seed", KEY} or len(grid["seed"]) < 2 or len(grid[KEY]) < 2:
        raise StudyRunError(
            f"sweep.grid: a study's pilot is a grid of seed (2 or more) x {KEY} (2 or more) and nothing else; "
            f"got {dict(grid)}"
        )
    if list(sel.over) != [KEY] or params.sweep.search is not None:
        raise StudyRunError(f"sweep.select.over: a study's pilot selects [{KEY}] on validation data")
    if params.finetune.control_lr is not None:
        raise StudyRunError("finetune.control_lr: the pilot chooses each arm's lr; drop it")


def choice(pilot_dir: Path) -> dict[str, dict[str, Any]]:
    """Each arm's pooled lr (selected_pooled.parquet) with its mean validation accuracy, its lead over the
    runner-up (fraction) and whether it is interior to the lrs the pilot ran (after bracketing)."""
    import pyarrow.parquet as pq

    pooled = pq.read_table(pilot_dir / "selected_pooled.parquet").to_pylist()
    ran = sorted({r[KEY] for r in pq.read_table(pilot_dir / "summary.parquet").to_pylist()})
    out = {}
    for arm in ARMS:
        recs = [r for r in pooled if r["arm"] == arm]
        if len(recs) != 1:
            raise StudyRunError(f"{pilot_dir}: no pooled lr for the {arm} arm (no seed finished every lr)")
        rec = recs[0]
        lr = rec[KEY]
        out[arm] = {"lr": lr, "val_accuracy": rec["value"], "margin": rec["margin"], "seeds": rec["seeds"],
                    "interior": ran[0] < lr < ran[-1], "grid": ran}  # fmt: skip
    return out


def pilot_differences(pilot_dir: Path, lrs: dict[str, float]) -> list[dict[str, Any]]:
    """Per pilot seed with both arms finished at their pooled lrs: each arm's clean accuracy and mCA (T-CNN
    from the trial at its lr, control from the trial at its own) and the T-CNN - control differences."""
    import pyarrow.parquet as pq

    rows = [r for r in pq.read_table(pilot_dir / "summary.parquet").to_pylist() if r["status"] == "finished"]
    at = {(r["seed"], r[KEY]): r for r in rows}
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        t, c = at.get((seed, lrs["tcnn"])), at.get((seed, lrs["control"]))
        if t is None or c is None:
            continue
        row: dict[str, Any] = {"seed": seed}
        for metric, _ in SIZED:
            row[f"tcnn_{metric}"], row[f"control_{metric}"] = t[f"tcnn_{metric}"], c[f"control_{metric}"]
            row[f"diff_{metric}"] = t[f"tcnn_{metric}"] - c[f"control_{metric}"]
        out.append(row)
    return out


def power(diffs: list[dict[str, Any]], max_seeds: int | None) -> dict[str, Any]:
    """The pilot's SD of each difference and the seeds it asks for (:func:`seeds_needed`, the 0.5 pp
    target); the main phase runs the largest, at least 2, capped at ``max_seeds`` (the cap is recorded)."""
    if len(diffs) < 2:
        raise StudyRunError(
            f"the pilot finished {len(diffs)} seed(s) at the chosen lrs: 2 are needed for an SD"
        )
    per = {}
    for metric, name in SIZED:
        sd = statistics.stdev(d[f"diff_{metric}"] for d in diffs)
        n = seeds_needed(sd) if sd > 0 else 2
        per[metric] = {"name": name, "sd": sd, "n": n, "half_width": half_width(sd, n)}
    asked = max(2, *(p["n"] for p in per.values()))
    n = asked if max_seeds is None else max(2, min(asked, max_seeds))
    return {"per_metric": per, "asked": asked, "n": n, "capped": n < asked, "pilot_seeds": len(diffs)}


def main_overrides(pilot_seeds: list[int], n: int, lrs: dict[str, float]) -> list[str]:
    """The main phase: ``n`` fresh seeds after the pilot's, each arm at its pooled lr, nothing selected."""
    first = max(pilot_seeds) + 1
    seeds = list(range(first, first + n))
    return [f"sweep.grid={{seed: {json.dumps(seeds)}}}", "sweep.select={over: []}",
            f"{KEY}={lrs['tcnn']!r}", f"finetune.control_lr={lrs['control']!r}"]  # fmt: skip


def answer(main_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The main phase's mean T-CNN - control with Student's 95% interval over its seeds (the sweep's
    seeds.parquet, core.robustness.intervals.t_interval) and its per-seed rows (summary.parquet)."""
    import pyarrow.parquet as pq

    (agg,) = pq.read_table(main_dir / "seeds.parquet").to_pylist()
    rows = [r for r in pq.read_table(main_dir / "summary.parquet").to_pylist() if r["status"] == "finished"]
    per_seed = [{"seed": r["seed"], **{f"{a}_{m}": r.get(f"{a}_{m}") for a in MODELS for m, _ in SIZED},
                 **{f"diff_{m}": r[f"tcnn_minus_control_{m}"] for m, _ in SIZED}}
                for r in sorted(rows, key=lambda r: r["seed"])]  # fmt: skip
    out: dict[str, Any] = {"n_seeds": agg["n_seeds"], "unit": agg["unit"], "seeds": json.loads(agg["seeds"])}
    for metric, name in SIZED:
        col = f"tcnn_minus_control_{metric}"
        lo, hi = agg[f"{col}_seeds_ci_low"], agg[f"{col}_seeds_ci_high"]
        means = {a: mean_of([r[f"{a}_{metric}"] for r in per_seed]) for a in MODELS}
        out[metric] = {"name": name, "means": means, "mean": agg[f"{col}_seeds_mean"], "low": lo, "high": hi,
                       "half_width": (hi - lo) / 2, "resolved": (hi - lo) / 2 <= TARGET + 1e-12,
                       "sign": "above" if lo > 0 else "below" if hi < 0 else "spans"}  # fmt: skip
    return out, per_seed


# ------------------------------------------------------------------------------------------------ the run


def run(params_file: Path, name: str, out: Path, *, overrides: list[str] | None = None,
        max_seeds: int | None = None, dry_run: bool = False, readme: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Run (or continue) the study; returns the record written to ``out/study.json``. Where it writes at the end
    (``out``, ``readme``) is checked first, before the pilot (core.utils.output_paths)."""
    from core.config import load_params
    from core.utils.output_paths import check_output_dir, check_output_file

    check_output_dir(out, "--out")
    if readme is not None:
        check_output_file(readme, "--readme")

    user = list(overrides or [])
    sets = [*(DRY_RUN if dry_run else []), *user]  # the user's overrides may resize a dry run
    sets += pilot_overrides(load_params(params_file, sets), dry_run)
    pilot_params = load_params(params_file, sets)
    check_pilot(pilot_params)
    if dry_run:
        max_seeds = min(max_seeds or DRY_RUN_SEEDS, DRY_RUN_SEEDS)
    pilot_dir = _sweep(pilot_params, f"{name}-pilot", params_file)
    picked = choice(pilot_dir)
    lrs = {arm: picked[arm]["lr"] for arm in ARMS}
    diffs = pilot_differences(pilot_dir, lrs)
    sized = power(diffs, max_seeds)
    main_sets = [*sets, *main_overrides(list(pilot_params.sweep.grid["seed"]), sized["n"], lrs)]
    main_dir = _sweep(load_params(params_file, main_sets), f"{name}-main", params_file)
    result, per_seed = answer(main_dir)
    result["sets"] = corrupted_sets(main_dir)
    record = {"name": name, "params": str(params_file), "overrides": sets, "dry_run": dry_run,
              "pilot": {"sweep": str(pilot_dir), "choice": picked, "seeds": [d["seed"] for d in diffs]},
              "power": sized, "main": {"sweep": str(main_dir), "overrides": main_sets[len(sets):]},
              "answer": result, "target_pp": 100 * TARGET}  # fmt: skip
    write(out, record, diffs, per_seed, readme)
    return record


def _sweep(params: Any, name: str, params_file: Path) -> Path:
    """One phase: the sweep ``name`` run here, or continued where it exists (its finished trials are kept);
    a trial that failed fails the study."""
    from pipelines.sweep.cli import say
    from pipelines.sweep.driver import run_sweep
    from pipelines.sweep.spec import build_spec

    spec = build_spec(params, name=name, params_file=params_file)
    say(f"study: phase {name}")
    res = run_sweep(spec, address="local", resume="auto")
    if res["failed"]:
        raise StudyRunError(f"sweep {name}: {res['failed']} trial(s) failed; see {res['sweep_dir']}")
    return Path(res["sweep_dir"])


def corrupted_sets(sweep_dir: Path) -> dict[str, Any]:
    """What mCA averages over, from the sweep's recorded params: corruptions x severities, images per set."""
    spec = json.loads((sweep_dir / "sweep.json").read_text())
    rob = next(iter(spec["trials"].values()))["params"]["robustness"]
    return {"corruptions": list(rob["corruptions"]), "severities": list(rob["severities"]),
            "n_images": rob["n_images"]}  # fmt: skip


# ---------------------------------------------------------------------------------------------- outputs


def write(out: Path, record: dict[str, Any], diffs: list[dict[str, Any]], per_seed: list[dict[str, Any]],
          readme: Path | None) -> list[Path]:  # fmt: skip
    """study.json, pilot.csv, main.csv and study.md in ``out``; the block in ``readme`` when given."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(record)
    files = [atomic_write_json(out / STATE, record), write_csv(out / "pilot.csv", diffs, _columns(diffs)),
             write_csv(out / "main.csv", per_seed, _columns(per_seed)),
             atomic_write_text(out / "study.md", text)]  # fmt: skip
    if readme is not None:
        files.append(insert_block(readme, record["name"], text))
    return files


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(rows[0]) if rows else ["seed"]


def _pp(v: float | None, sign: bool = True) -> str:
    return (
        "n/a"
        if v is None or (isinstance(v, float) and math.isnan(v))
        else f"{100 * v:{'+' if sign else ''}.2f}"
    )


def sentence(res: dict[str, Any], unit: str) -> str:
    """What the interval says, in words (a difference is claimed only where the interval excludes 0)."""
    ci = f"{_pp(res['mean'])} pp, 95% CI [{_pp(res['low'])}, {_pp(res['high'])}] over {unit}"
    if res["sign"] == "spans":
        claim = f"no difference resolved ({ci})"
    else:
        claim = f"the T-CNN is {'above' if res['sign'] == 'above' else 'below'} its control ({ci})"
    width = "within" if res["resolved"] else "wider than"
    return f"{res['name']}: {claim}; half-width {100 * res['half_width']:.2f} pp, {width} the +-0.5 pp asked."


def markdown(rec: dict[str, Any]) -> str:
    """The study's block: the pilot's choice, the power arithmetic and the answer with its sentences."""
    ch, pw, ans = rec["pilot"]["choice"], rec["power"], rec["answer"]
    lines = [f"**{rec['name']}** (`tcnn study run {rec['params']}`" + (", a dry run at smoke size: it checks "
             "the chain and answers nothing)." if rec["dry_run"] else ")."), ""]  # fmt: skip
    lines.append(f"1. Pilot: seeds {rec['pilot']['seeds']} x {KEY} {ch['tcnn']['grid']}; each arm's lr is the "
                 "best mean validation accuracy over the pilot seeds (the same rule for both arms):")  # fmt: skip
    for arm, label in (("tcnn", "T-CNN"), ("control", "control")):
        c = ch[arm]
        lead = "no runner-up" if c["margin"] is None else f"{100 * c['margin']:.2f} pp ahead of the runner-up"
        where = "interior" if c["interior"] else "at an edge of the grid: not bracketed"
        lines.append(
            f"   - {label}: lr {c['lr']:g} (validation {100 * c['val_accuracy']:.2f}%, {lead}; {where})"
        )
    lines += ["2. Power: the pilot's SD of T-CNN - control at those lrs, and the seeds that bring Student's 95% "
              "half-width to 0.5 pp:", "", "   | difference | pilot SD (pp) | seeds for +-0.5 pp | half-width there (pp) |",
              "   |---|---:|---:|---:|"]  # fmt: skip
    for p in pw["per_metric"].values():
        lines.append(f"   | {p['name']} | {100 * p['sd']:.2f} | {p['n']} | {100 * p['half_width']:.2f} |")
    cap = f", capped from {pw['asked']}" if pw["capped"] else ""
    lines += ["", f"3. Main: {pw['n']} fresh seeds {ans['seeds']}{cap}, each arm at its pilot lr; the interval "
              f"runs over {ans['unit']} (means over the main seeds, %; the CNN as imported or pretrained).", "",
              "   | | CNN | control | T-CNN | T-CNN - control (pp) | 95% CI (pp) | half-width (pp) |",
              "   |---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m, _ in SIZED:
        r = ans[m]
        models = " | ".join(_pp(r["means"][a], sign=False) for a in MODELS)
        lines.append(f"   | {r['name']} | {models} | {_pp(r['mean'])} | [{_pp(r['low'])}, {_pp(r['high'])}] "
                     f"| {100 * r['half_width']:.2f} |")  # fmt: skip
    sets = ans["sets"]
    lines += ["", f"   mCA is the mean accuracy over {len(sets['corruptions'])} corruptions x "
              f"{len(sets['severities'])} severities ({', '.join(sets['corruptions'])}; severities "
              f"{', '.join(map(str, sets['severities']))}), up to {sets['n_images']} test images per set; "
              "a difference of 1 pp is 1 pp of that mean accuracy.", ""]  # fmt: skip
    lines += [f"   - {sentence(ans[m], ans['unit'])}" for m, _ in SIZED]
    return "\n".join(lines) + "\n"


def insert_block(readme: Path, name: str, text: str) -> Path:
    """Replace (or append) the block between ``<!-- study:NAME:begin -->`` and its end marker."""
    from pipelines.studies.render import with_block

    old = readme.read_text() if readme.is_file() else ""
    new = with_block(old, name, text)
    if new is None:
        sep = "\n" if old and not old.endswith("\n") else ""
        new = f"{old}{sep}<!-- study:{name}:begin -->\n{text}<!-- study:{name}:end -->\n"
    return atomic_write_text(readme, new)
