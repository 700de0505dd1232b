"""`tcnn study snapshot`: how far a running `tcnn study run` is, as small rows to commit while it runs.

    tcnn study snapshot --sweeps SWEEPS_DIR --name NAME --out DIR

A study runs for many hours across sessions (issue 57); a lost machine must lose at most the trial in flight.
This reads, without touching the run, what its sweeps (``NAME-search``, ``NAME-seed<k>``) have recorded so far
and writes ``DIR/progress.csv``: one row per trial that has reported, with its phase, point, arm, lr, the last
``epoch`` it reported (Tune's counter, as the search's own search.csv has it), its last validation accuracy, and its state: ``finished`` (its last stage wrote ``done.json``),
``refused``, ``running`` (its trial holds its directory's lock now) or ``stopped or interrupted`` (the
search's scheduler stopped it, or its process ended before it finished; the search's own report, written when
it finishes, says which). ``DIR/progress.json`` adds the trials finished and the
compute recorded so far per phase (:func:`pipelines.studies.results.compute_hours`: finished training stages and
other stages' recorded times; an epoch in flight is not counted). Read from Tune's per-trial ``params.json`` and
``result.json`` (one JSON line per report) and the trials' own files.

``DIR/trials/<sweep>/<trial>.json``: each trial that finished, was refused or was stopped, as a record a fresh
machine replays instead of training it again (pipelines.sweep.replay; ``tcnn study run --records``, by default
``OUT/trials``). A trial in flight is not recorded.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from pipelines.studies.study_tables import StudyError, write_csv
from pipelines.sweep import replay
from pipelines.sweep.arm_trial import config_params

COLUMNS = ["phase", "trial", "point", "arm", "finetune.lr", "epoch", "val_acc", "state", "test_acc"]


def phases(sweeps: Path, name: str) -> list[tuple[str, Path]]:
    """The study's sweeps that exist, search first then seeds in order: (phase, sweep directory)."""
    found = [("search", sweeps / f"{name}-search")]
    seeds = [(int(m.group(1)), p) for p in sweeps.glob(f"{name}-seed*")
             if (m := re.fullmatch(rf"{re.escape(name)}-seed(\d+)", p.name))]  # fmt: skip
    found += [(f"seed{k}", p) for k, p in sorted(seeds)]
    return [(ph, p) for ph, p in found if (p / "sweep.json").is_file()]


def trial_rows(phase: str, sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per Tune trial of a sweep that has its params: the last report of each epoch counts."""
    from pipelines.sweep.replay import DONE, REFUSED
    from pipelines.sweep.trial_files import read_json

    rows = []
    for t in sorted((sweep_dir / "tune").glob("*/params.json")):
        config, reports = json.loads(t.read_text()), replay.reports(t.parent)
        tid = t.parent.name
        root = sweep_dir / "trials" / tid
        done, refused = read_json(root / DONE), read_json(root / REFUSED)
        by_epoch = {
            int(r["epoch"]): r["val_acc"] for r in reports if r.get("epoch") is not None and "val_acc" in r
        }
        last = max(by_epoch) if by_epoch else None
        state = ("refused" if refused is not None else "finished" if done is not None
                 else "running" if replay.in_flight(root) else "stopped or interrupted")  # fmt: skip
        rows.append({"phase": phase, "trial": tid, "point": config.get("point"), "arm": config.get("arm"),
                     "finetune.lr": config.get("finetune.lr"), "epoch": last,
                     "val_acc": None if last is None else by_epoch[last], "state": state,
                     "test_acc": (done or {}).get("test_acc")})  # fmt: skip
    return rows


def snapshot(sweeps: Path, name: str, out: Path, *, records: bool = True) -> dict[str, Any]:
    """progress.csv and progress.json in ``out`` for the study ``name`` whose sweeps are under ``sweeps``, and
    (``records``) each finished, refused or stopped trial's record in ``out/trials`` (pipelines.sweep.replay)."""
    from pipelines.studies.run import RECORDS, compute

    found = phases(sweeps, name)
    if not found:
        raise StudyError(f"no sweep {name}-search under {sweeps}: is the study's name right?")
    rows = [r for phase, d in found for r in trial_rows(phase, d)]
    summary = {"name": name, "phases": {}}
    for phase, d in found:
        mine = [r for r in rows if r["phase"] == phase]
        summary["phases"][phase] = {"trials_reported": len(mine),
                                    "trials_finished": sum(r["state"] == "finished" for r in mine),
                                    **compute(d)}  # fmt: skip
    summary["compute_h"] = round(sum(p["compute_h"] for p in summary["phases"].values()), 2)
    out.mkdir(parents=True, exist_ok=True)
    written = [p for _, d in found for p in replay.export(d, out / RECORDS, config_params)] if records else []
    summary["trials_recorded"] = sum(1 for _ in (out / RECORDS).glob(f"{name}-*/*.json"))
    write_csv(out / "progress.csv", rows, COLUMNS)
    atomic_write_json(out / "progress.json", summary)
    return {**summary, "records_written": written}


def progress_block(out: Path, *, table: bool = True) -> str:
    """The progress lines of a running study, from the snapshot committed in ``out`` (progress.json,
    progress.csv): per phase the trials finished, stopped or in flight and the compute recorded, and
    (``table``) the search's trials with their lr and last validation accuracy (the choice itself is the
    finished search's). The README shows the lines, the main seeds in one (its length stays fixed as seeds
    come), docs/studies.md a line per phase and the table."""
    import csv

    summary = json.loads((out / "progress.json").read_text())
    with open(out / "progress.csv") as fh:
        rows = list(csv.DictReader(fh))
    lines = [f"Progress of `{summary['name']}` (`tcnn study snapshot`; {out.name}/progress.csv, "
             f"{summary.get('trials_recorded', 0)} trial record(s) in {out.name}/trials): "
             f"{summary['compute_h']:.2f} h of compute recorded."]  # fmt: skip
    phases = summary["phases"].items()
    seeds = [(k, p) for k, p in phases if k != "search"]
    if not table and len(seeds) > 1:  # the README's: one line for the main seeds, whatever their number
        cpus = sorted({p.get("cpus") or "unrecorded CPUs" for _, p in seeds})
        phases = [(k, p) for k, p in phases if k == "search"] + [
            (f"main seeds ({seeds[0][0]}-{seeds[-1][0]})",
             {"trials_finished": sum(p["trials_finished"] for _, p in seeds),
              "trials_reported": sum(p["trials_reported"] for _, p in seeds),
              "compute_h": sum(p["compute_h"] for _, p in seeds), "cpus": ", ".join(cpus)})]  # fmt: skip
    for phase, p in phases:
        lines.append(f"- {phase}: {p['trials_finished']} trial(s) finished of {p['trials_reported']} reported, "
                     f"{p['compute_h']:.2f} h on {p.get('cpus') or 'unrecorded CPUs'}")  # fmt: skip
    search = [r for r in rows if r["phase"] == "search"]
    if search and table:
        lines += ["", "| search trial | arm | lr (batch 1024) | last epoch | val acc | state |",
                  "|---|---|---:|---:|---:|---|"]  # fmt: skip
        for r in search:
            acc = f"{100 * float(r['val_acc']):.2f}%" if r["val_acc"] else "-"
            lines.append(f"| {r['trial']} | {r['arm']} | {float(r['finetune.lr']):.3g} | {r['epoch'] or '-'} | "
                         f"{acc} | {r['state']} |")  # fmt: skip
    return "\n".join(lines) + "\n"
