"""`tcnn study run`: a powered T-CNN vs control answer in one resumable command (issues 48 and 57).

    tcnn study run PARAMS --name NAME --out DIR [--readme README.md] [--max-seeds N] [--dry-run] [-S k=v ...]

The steps, each a sweep or a pure function of finished sweeps, so that running the command again continues
where it stopped (a sweep resumes with its finished trials kept) and rewrites the same outputs:

1. **Search** (sweep ``NAME-search``, the params' ``sweep.search`` over ``finetune.lr`` with ASHA within each
   arm, pipelines/sweep/search.py): one seed (the params' ``seed``), validation images only, no evaluate stage;
   each arm takes its best validation accuracy among at least ``sweep.search.min_finished`` trials that
   trained every epoch (``chosen.json``: its lr, its candidates, the runner-up and the margin in images).
2. **Main seeds, sequentially** (one sweep ``NAME-seed<k>`` per seed, each arm at its chosen lr:
   ``finetune.lr`` / ``finetune.control_lr``): seeds after the search's, the first 3, then one at a time until
   Student's 95% half-width of T-CNN - control is at most 0.5 pp on clean accuracy and on mCA, or ``--max-seeds``
   (:mod:`pipelines.studies.sequential`: the rule, stated before the run, and its simulated coverage).
3. **Answer**: the main seeds' mean difference with Student's 95% interval (core.robustness.intervals), so
   the lr was chosen on a seed the answer does not use.
4. **Export** after every phase and seed: ``DIR/study.json`` (every figure; ``"state"`` says how far it is),
   ``DIR/search.csv`` (the search's trials), ``DIR/main.csv`` (per seed), ``DIR/study.md`` (the block), and
   with ``--readme`` the block between ``<!-- study:NAME:begin/end -->``.

``--dry-run`` runs the same steps at a smoke size (:data:`DRY_RUN`: capped splits, one epoch, one corrupted
set, a 2-point search, 2 main seeds) on the CPU: it checks the chain, it answers nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json, atomic_write_text
from pipelines.studies import sequential
from pipelines.studies.study_block import (  # the study's facts, shared with its block
    ARMS,
    KEY,
    MODELS,
    RECORDS,
    REPORTED,
    SIZED,
    STATE,
    StudyRunError,
)
from pipelines.studies.study_tables import write_csv
from pipelines.sweep.selection import mean_of

#: --dry-run: the smoke size (data.limit caps each split; a capped run answers nothing).
DRY_RUN = [
    "data.limit={train: 256, val: 128, test: 128}",
    "finetune.epochs=1",
    "finetune.stop=null",
    "robustness.n_images=32",
    "robustness.corruptions=[gaussian_noise]",
    "robustness.severities=[1]",
    "robustness.bootstrap=50",
    "sweep.search.num_samples=2",
    "sweep.search.min_finished=2",
    "sweep.scheduler=null",
]
DRY_RUN_SEEDS = 2


def check_search(params: Any) -> None:
    """The design this command runs: a search over ``finetune.lr`` alone (both arms at the same points), no
    grid, the control's lr left to the search, validation images to choose on."""
    search = params.sweep.search
    if search is None or list(search.space) != [KEY]:
        raise StudyRunError(f"sweep.search: a study chooses each arm's lr by a search over {KEY} alone; "
                            f"got {None if search is None else list(search.space)}")  # fmt: skip
    if params.sweep.grid:
        raise StudyRunError(f"sweep.grid: a study's search replaces the grid; got {dict(params.sweep.grid)}")
    if params.finetune.control_lr is not None:
        raise StudyRunError("finetune.control_lr: the search chooses each arm's lr; drop it")


def choice(search_dir: Path, min_finished: int, *, force: bool = False) -> dict[str, dict[str, Any]]:
    """Each arm's chosen lr from the search's ``chosen.json``: its validation accuracy, its candidates (trials
    that trained every epoch), the runner-up and the margin in validation images, whether it was a tie and
    whether it is interior to the lrs that finished."""
    picks = json.loads((search_dir / "chosen.json").read_text())
    out = {}
    for arm in ARMS:
        p = picks.get(arm)
        if p is None:
            raise StudyRunError(f"{search_dir}: no trial of the {arm} arm trained every epoch: no lr to use")
        n = int(p.get("candidates", 0))
        if n < min_finished and not force:
            raise StudyRunError(f"{search_dir}: the {arm} arm chose among {n} finished trial(s), fewer than "
                                f"sweep.search.min_finished = {min_finished}")  # fmt: skip
        out[arm] = {"lr": float(p[KEY]), "val_accuracy": float(p["val_acc"]), "candidates": n,
                    "runner_up": p.get("runner_up"), "margin_images": p.get("margin_images"),
                    "tie": bool(p.get("tie", False))}  # fmt: skip
    return out


def main_overrides(seed: int, lrs: dict[str, float]) -> list[str]:
    """One main seed: a grid of that seed alone, each arm at its chosen lr, no search, nothing selected."""
    return [f"sweep.grid={{seed: [{seed}]}}", "sweep.search=null", "sweep.scheduler=null",
            "sweep.select={over: []}", f"{KEY}={lrs['tcnn']!r}", f"finetune.control_lr={lrs['control']!r}"]  # fmt: skip


def seed_row(sweep_dir: Path) -> dict[str, Any]:
    """A finished main seed's row (its sweep's summary.parquet): each model's metrics and the differences."""
    import pyarrow.parquet as pq

    rows = [r for r in pq.read_table(sweep_dir / "summary.parquet").to_pylist() if r["status"] == "finished"]
    if len(rows) != 1:
        raise StudyRunError(f"{sweep_dir}: expected one finished trial, found {len(rows)}")
    (r,) = rows
    out: dict[str, Any] = {"seed": r["seed"]}
    for m, _ in REPORTED:
        out |= {f"{a}_{m}": r.get(f"{a}_{m}") for a in MODELS}
        col = f"tcnn_minus_control_{m}"
        # the difference, and its paired bootstrap 95% interval over this seed's test images (evaluate stage)
        out |= {f"diff_{m}": r.get(col), f"diff_{m}_images_low": r.get(f"{col}_ci_low"),
                f"diff_{m}_images_high": r.get(f"{col}_ci_high")}  # fmt: skip
    return out | compute(sweep_dir)


def attention_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """Every GPSA head of the seed's T-CNN over fine-tuning (the finetune stage's gpsa.csv: gate sigma(lambda),
    span 1/alpha, nonlocality per epoch), with its seed."""
    import csv

    from stages.harness import chain

    spec = json.loads((sweep_dir / "sweep.json").read_text())
    out = []
    for tid, t in spec["trials"].items():
        gpsa = sweep_dir / "trials" / tid / chain.output("finetune", "gpsa.csv")
        if gpsa.is_file():
            with open(gpsa) as fh:
                out += [{"seed": t["params"]["seed"], **r} for r in csv.DictReader(fh)]
    return out


def compute(sweep_dir: Path) -> dict[str, Any]:
    """A phase's compute as its records say (pipelines.studies.results: training epochs kept, stages' and the
    driver's recorded times) and the CPUs it ran on."""
    from pipelines.studies.results import _cpus, compute_hours

    spec = json.loads((sweep_dir / "sweep.json").read_text())
    return {"compute_h": compute_hours(sweep_dir, spec), "cpus": "; ".join(_cpus(sweep_dir, spec["name"]))}


def answer(per_seed: list[dict[str, Any]], unit: str) -> dict[str, Any]:
    """The main seeds' mean T-CNN - control with Student's 95% interval (core.robustness.intervals.t_interval)
    for each reported metric, each model's mean, and whether the sized half-widths reached the target."""
    from core.robustness.intervals import t_interval

    out: dict[str, Any] = {"n_seeds": len(per_seed), "unit": unit, "seeds": [r["seed"] for r in per_seed]}
    for metric, name in REPORTED:
        ci = t_interval([r[f"diff_{metric}"] for r in per_seed])
        lo, hi, mean = ci["low"], ci["high"], ci["mean"]
        half = None if lo is None else (hi - lo) / 2
        means = {a: mean_of([r[f"{a}_{metric}"] for r in per_seed]) for a in MODELS}
        sign = "spans" if lo is None or lo <= 0 <= hi else "above" if lo > 0 else "below"
        out[metric] = {"name": name, "means": means, "mean": mean, "low": lo, "high": hi, "half_width": half,
                       "resolved": half is not None and half <= sequential.TARGET + 1e-12, "sign": sign,
                       "lower_is_better": metric == "mce", "sized": metric in dict(SIZED)}  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------------ the run


def run(params_file: Path, name: str, out: Path, *, overrides: list[str] | None = None,
        max_seeds: int | None = None, dry_run: bool = False, readme: Path | None = None,
        force: bool = False, records: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """Run (or continue) the study; returns the record written to ``out/study.json``. Where it writes
    (``out``, ``readme``) is checked first, before the search (core.utils.output_paths). ``records`` (default
    ``out/trials``, where `tcnn study snapshot` writes them): trials recorded on another machine, replayed
    instead of trained (pipelines.sweep.replay)."""
    from core.utils.output_paths import check_output_dir, check_output_file
    from pipelines.sweep.sweep_params import load_sweep_params

    check_output_dir(out, "--out")
    if readme is not None:
        check_output_file(readme, "--readme")

    sets = [*(DRY_RUN if dry_run else []), *list(overrides or [])]  # the user's may resize a dry run
    params = load_sweep_params(params_file, sets)
    check_search(params)
    first, cap = (
        (DRY_RUN_SEEDS, DRY_RUN_SEEDS) if dry_run else (sequential.FIRST, max_seeds or sequential.CAP)
    )
    cap = max(first, cap)
    records = records if records is not None else out / RECORDS
    if records.exists() and not records.is_dir():
        raise StudyRunError(f"--records {records}: not a folder")
    search_dir = _sweep(params, f"{name}-search", params_file, records)
    picked = choice(search_dir, params.sweep.search.min_finished, force=force or dry_run)
    lrs = {arm: picked[arm]["lr"] for arm in ARMS}
    record: dict[str, Any] = {"name": name, "params": str(params_file), "overrides": sets, "dry_run": dry_run,
                              "search": {"sweep": str(search_dir), "seed": params.seed, "choice": picked,
                                         "space": params.sweep.search.space[KEY],
                                         "points": params.sweep.search.num_samples},
                              "rule": {"first": first, "cap": cap, "target_pp": 100 * sequential.TARGET},
                              "main": {"seeds": []}, "target_pp": 100 * sequential.TARGET}  # fmt: skip
    unit = "seeds of one CNN"
    per_seed: list[dict[str, Any]] = []
    attention: list[dict[str, Any]] = []
    record["search"]["compute"] = compute(search_dir)
    record["state"] = "running: the search finished, main seeds next"
    write(out, record, search_rows(search_dir), per_seed, attention, readme)  # the search's rows, to commit
    seed = params.seed + 1
    while True:
        step = sequential.decide(
            {m: [r[f"diff_{m}"] for r in per_seed] for m, _ in SIZED}, first=first, cap=cap
        )
        record["rule"]["last"] = step
        if step["run"] == 0:
            break
        main_dir = _sweep(load_sweep_params(params_file, [*sets, *main_overrides(seed, lrs)]), f"{name}-seed{seed}",
                          params_file, records)  # fmt: skip
        per_seed.append(seed_row(main_dir))
        attention += attention_rows(main_dir)
        record["main"]["seeds"].append({"seed": seed, "sweep": str(main_dir), **compute(main_dir)})
        record["answer"] = answer(per_seed, unit) if len(per_seed) >= 2 else None
        record["answer_sets"] = corrupted_sets(main_dir)
        record["state"] = f"running: {len(per_seed)} main seed(s) finished"
        record["attention"] = heads(attention)
        write(out, record, search_rows(search_dir), per_seed, attention, readme)
        seed += 1
    record["answer"] = answer(per_seed, unit)
    record["state"] = f"finished: {len(per_seed)} main seeds ({step['reason']})"
    record["attention"] = heads(attention)
    write(out, record, search_rows(search_dir), per_seed, attention, readme)
    return record


def _sweep(params: Any, name: str, params_file: Path, records: Path) -> Path:
    """One phase: the sweep ``name`` run here, or continued where it exists (its finished trials are kept), its
    trials recorded under ``records`` replayed; a trial that failed fails the study."""
    from pipelines.sweep.cli import say
    from pipelines.sweep.driver import run_sweep
    from pipelines.sweep.sweep_spec import build_spec

    spec = build_spec(params, name=name, params_file=params_file)
    spec["records"] = str(records.resolve()) if (records / name).is_dir() else None
    replays = f" (replaying the trials recorded in {records / name})" if spec["records"] else ""
    say(f"study: phase {name}{replays}")
    res = run_sweep(spec, address="local", resume="auto")
    if res["failed"]:
        raise StudyRunError(f"sweep {name}: {res['failed']} trial(s) failed; see {res['sweep_dir']}")
    return Path(res["sweep_dir"])


def search_rows(search_dir: Path) -> list[dict[str, Any]]:
    """The search's trials (search.parquet), without their curves: point, arm, lr, status, epochs, val acc."""
    import pyarrow.parquet as pq

    keep = ("trial", "point", "arm", KEY, "status", "epoch", "val_acc")
    return [{k: r.get(k) for k in keep} for r in pq.read_table(search_dir / "search.parquet").to_pylist()]


def corrupted_sets(sweep_dir: Path) -> dict[str, Any]:
    """What mCA averages over, from the sweep's recorded params: corruptions x severities, images per set."""
    spec = json.loads((sweep_dir / "sweep.json").read_text())
    rob = next(iter(spec["trials"].values()))["params"]["robustness"]
    return {"corruptions": list(rob["corruptions"]), "severities": list(rob["severities"]),
            "n_images": rob["n_images"]}  # fmt: skip


def heads(attention: list[dict[str, Any]]) -> dict[str, Any]:
    """The attention analysis of the first CIFAR-10 study (pipelines/studies/render.py): how many heads became
    content-based (gate sigma(lambda) below core.viz.study_plots.CONTENT_GATE) at the end of fine-tuning in each
    seed's T-CNN, in a sentence, and the heads' mean span 1/alpha there against its start."""
    from pipelines.studies.render import _heads_sentence

    if not attention:
        return {"sentence": _heads_sentence([]), "span_start": None, "span_end": None}
    first, last = min(int(r["epoch"]) for r in attention), max(int(r["epoch"]) for r in attention)

    def span(epoch: int) -> float | None:
        return mean_of([float(r["inv_alpha"]) for r in attention if int(r["epoch"]) == epoch])

    return {"sentence": _heads_sentence(attention), "span_start": span(first), "span_end": span(last),
            "epochs": [first, last]}  # fmt: skip


# ---------------------------------------------------------------------------------------------- outputs


def write(out: Path, record: dict[str, Any], searched: list[dict[str, Any]], per_seed: list[dict[str, Any]],
          attention: list[dict[str, Any]], readme: Path | None) -> list[Path]:  # fmt: skip
    """study.json, search.csv, main.csv, attention.csv (+ attention.png) and study.md in ``out``; the block in
    ``readme`` when given."""
    from core.viz.study_plots import plot_head_gates
    from pipelines.studies.study_block import block, insert_block

    out.mkdir(parents=True, exist_ok=True)
    files = [atomic_write_json(out / STATE, record), write_csv(out / "search.csv", searched, _columns(searched)),
             write_csv(out / "main.csv", per_seed, _columns(per_seed)),
             write_csv(out / "attention.csv", attention, _columns(attention))]  # fmt: skip
    text = block(out, record)  # after search.csv: the block reads it back
    files.append(atomic_write_text(out / "study.md", text))
    if attention:
        plot_head_gates(attention, out / "attention.png", title=record["name"])
        files.append(out / "attention.png")
    if readme is not None:
        files.append(insert_block(readme, record["name"], text))
    return files


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(rows[0]) if rows else ["seed"]
