"""A search's run in the sweep driver (``sweep.search``): its Tune experiment (run or restored), then its report
(pipelines/sweep/search_report.py) on the parent run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_json
from pipelines.sweep.driver_legs import wall_metrics
from pipelines.sweep.driver_lines import say
from pipelines.sweep.tuner import can_restore, tune_dir


def run_search(spec: dict, tracker: Any, sweep_dir: Path, t0: float) -> dict:
    """A search (``sweep.search``): its Tune experiment (run or restored), then its report
    (pipelines/sweep/search_report.py) on the parent run; the parent ends FINISHED when every arm chose."""
    from pipelines.sweep import search_report as sr
    from pipelines.sweep import shared
    from pipelines.sweep.tuner import make_search_tuner

    path = sweep_dir / tune_dir(0)
    restore = can_restore(path)
    if restore:
        say(f"resuming from {path}")
    rows = sr.search_rows(spec, make_search_tuner(spec, restore).fit())
    sr.close_stopped(spec, rows)
    picks = sr.chosen(rows, sr.max_epochs(spec))
    files = sr.write(spec, rows, picks)
    runs = shared.pretrain_runs(sweep_dir)
    metrics = {**sr.parent_metrics(spec, rows, picks), "pretrain_runs": runs, **wall_metrics(sweep_dir, t0)}
    failed = sum(r["status"] in ("error", "refused") for r in rows)  # a stopped trial did not fail
    tracker.log_metrics(metrics)
    if tracker.enabled:
        for p in files:
            tracker.log_artifact(p, "plots" if p.suffix == ".png" else None)
        tracker.log_dict(spec["search"], "search.json")
        tracker.end_parent("FINISHED" if all(picks.values()) and not failed else "FAILED")
    atomic_write_json(sweep_dir / "metrics.json", metrics)
    print(sr.markdown(spec, rows, picks), flush=True)
    for r in rows:
        if r["status"] in ("error", "refused"):
            say(f"trial {r['trial']}: {r['status']}")
    finished = sum(r["status"] == "finished" for r in rows)
    say(
        f"{finished}/{len(rows)} search trials trained every epoch, {failed} failed; report {sweep_dir / 'search.md'}"
    )
    return {"trials": len(rows), "finished": finished, "failed": failed,
            "pretrain_runs": runs, "sweep_dir": str(sweep_dir), "summary": str(files[0]),
            "plots": [str(p) for p in files if p.suffix == ".png"], "parent_run_id": spec["tracking"]["parent_run_id"],
            "chosen": {arm: (p or {}).get("trial") for arm, p in picks.items()}}  # fmt: skip
