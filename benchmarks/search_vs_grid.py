"""ASHA + random search vs the bracketed grid over the fine-tuning lr, measured in one run (issue 49 item 7).

    .venv/bin/python benchmarks/search_vs_grid.py [--workdir DIR] [--out FILE] [--quick]

The problem (PROBLEM below): the first n_train + n_val images of Fashion-MNIST's training split (n_val of them
carved out as the validation split both sweeps choose on: data.val_size) and the first n_test of its test split,
written by the tests' own slice writer; ``arch`` pretrained ``pretrain_epochs`` epochs, reparameterized at its
last epoch, then each arm (the T-CNN and its matched control) fine-tuned ``finetune_epochs`` epochs at batch
``batch``.
Two `tcnn sweep` runs back to back in one work directory, sharing one pretraining (equal pretraining params,
one ``sweep.storage``; the grid runs first and pays for it):

- grid: ``sweep.grid.finetune.lr`` = GRID_LRS (a decade apart), chosen per arm on validation accuracy, with
  ``sweep.select.bracket.max_rounds`` = BRACKET_ROUNDS (pipelines/sweep/bracket.py);
- search: ``sweep.search`` random over finetune.lr ~ loguniform SEARCH_RANGE, ``points`` points x 2 arms,
  ``sweep.scheduler`` ASHA within each arm (grace period 1, reduction factor 2; pipelines/sweep/scheduling.py).

Everything reported is read from each sweep's own outputs: the grid's selected.parquet (each arm's chosen lr
and its validation accuracy), summary.parquet (its trials) and bracket.json; the search's chosen.json,
search.parquet (each trial's arm and the epochs it trained) and metrics.json (search_epochs_trained, checked
against the per-arm sums); wall times are each `tcnn sweep` process's, measured here. Fine-tuning epochs
trained is the compute measure: a grid trial trains every epoch in both arms (no ``finetune.stop``), a search
trial the epochs it reported before ASHA stopped it. The grid's trials also run the evaluate stage (clean test
set and ROBUSTNESS's corrupted sets) that search trials do not: that is in its wall time, not in its epochs.
``--quick`` shrinks everything to check the script (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

ARMS = ("tcnn", "control")
KEY = "finetune.lr"
GRID_LRS = [3e-3, 3e-2, 3e-1]  # at batch 1024, scaled by batch/1024 (core.config FinetuneConfig.scaled_lrs)
BRACKET_ROUNDS = 2
SEARCH_RANGE = [1e-3, 1.0]  # half a decade wider than the asked grid on each side
PROBLEM = {"n_train": 2000, "n_val": 500, "n_test": 500, "arch": "resnet10_cifar", "pretrain_epochs": 3,
           "finetune_epochs": 6, "batch": 64, "points": 8}  # fmt: skip
QUICK = {"n_train": 300, "n_val": 100, "n_test": 100, "arch": "resnet10_cifar", "pretrain_epochs": 1,
         "finetune_epochs": 3, "batch": 50, "points": 4}  # fmt: skip
ROBUSTNESS = {
    "n_images": 100,
    "corruptions": ["gaussian_noise"],
    "severities": [3],
    "dir": "data-c",
    "workers": 1,
}
ENV = {
    "TCNN_TRACKING": "1",
    "TCNN_QUIET": "1",
    "OMP_NUM_THREADS": "1",
    "TCNN_DEVICE": "cpu",
    "PYTHONHASHSEED": "0",
}


# ------------------------------------------------------------------------------------------ the problem


def base_params(p: dict[str, Any]) -> dict[str, Any]:
    """The params both sweeps share (the pretraining above all: one shared pretraining run)."""
    from _train_helpers import tiny_params  # the tests' tiny config, sized up here

    raw = tiny_params(
        Path("data"),
        model={"kind": "tcnn", "arch": p["arch"]},
        pretrain={
            "epochs": p["pretrain_epochs"],
            "batch_size": p["batch"],
            "lr": 0.05,
            "warmup_epochs": 0.5,
            "checkpoint_every_steps": 0,
        },  # fmt: skip
        reparam={"epoch": p["pretrain_epochs"]},
        finetune={
            "epochs": p["finetune_epochs"],
            "batch_size": p["batch"],
            "lr": GRID_LRS[1],
            "warmup_epochs": 0.3,
            "checkpoint_every_steps": 0,
        },  # fmt: skip
        robustness=dict(ROBUSTNESS),
        tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "search_vs_grid"},
    )
    raw["data"]["val_size"] = p["n_val"]
    raw["sweep"] = {"cpus_per_trial": 1, "max_failures": 0, "storage": "sweeps"}
    return raw


def grid_params(base: dict[str, Any]) -> dict[str, Any]:
    sweep = {**base["sweep"], "grid": {KEY: list(GRID_LRS)},
             "select": {"over": [KEY], "bracket": {"max_rounds": BRACKET_ROUNDS}}}  # fmt: skip
    return {**base, "sweep": sweep}


def search_params(base: dict[str, Any], points: int) -> dict[str, Any]:
    search = {"space": {KEY: {"loguniform": list(SEARCH_RANGE)}}, "algorithm": "random",
              "num_samples": points, "seed": 0}  # fmt: skip
    scheduler = {"kind": "asha", "grace_period": 1, "reduction_factor": 2}
    return {**base, "sweep": {**base["sweep"], "search": search, "scheduler": scheduler}}


def make_project(root: Path, p: dict[str, Any]) -> dict[str, Path]:
    """data/ (the Fashion-MNIST slice) and the two sweeps' params files in ``root``."""
    from _train_helpers import write_dataset

    write_dataset(root / "data", p["n_train"] + p["n_val"], p["n_test"])
    base = base_params(p)
    files = {"grid": root / "grid.yaml", "search": root / "search.yaml"}
    files["grid"].write_text(yaml.safe_dump(grid_params(base), sort_keys=False))
    files["search"].write_text(yaml.safe_dump(search_params(base, p["points"]), sort_keys=False))
    return files


# --------------------------------------------------------------------------------------------- running


def sweep_cmd(params: Path, name: str) -> list[str]:
    return ["tcnn", "sweep", "--params", params.name, "--num-cpus", "2", "--name", name]


def run(root: Path, params: Path, name: str) -> float:
    """One `tcnn sweep` (its log kept in ``root/<name>.log``); its wall time in seconds."""
    cmd = sweep_cmd(params, name)
    exe = [str(Path(sys.executable).with_name("tcnn")), *cmd[1:]]
    print(f"benchmark: {shlex.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    res = subprocess.run(exe, cwd=root, env={**os.environ, **ENV}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    (root / f"{name}.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        sys.exit(
            f"benchmark: sweep {name} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    print(f"benchmark: {name} took {wall:.0f} s", flush=True)
    return wall


# ----------------------------------------------------------------------------------- reading the outputs


def _rows(path: Path) -> list[dict[str, Any]]:
    return pq.read_table(path).to_pylist()


def grid_result(sweep_dir: Path) -> dict[str, Any]:
    """Per arm: the chosen lr and its validation accuracy (selected.parquet), and the epochs its trials trained
    (summary.parquet: a finished grid trial fine-tunes both arms for its ``finetune_epochs``); the bracketing."""
    (sel,) = _rows(sweep_dir / "selected.parquet")  # one configuration, one seed
    trials = _rows(sweep_dir / "summary.parquet")
    finished = [t for t in trials if t["status"] == "finished"]
    epochs = sum(int(t["finetune_epochs"]) for t in finished)
    bracket = json.loads((sweep_dir / "bracket.json").read_text())
    arms = {arm: {"lr": sel[f"{arm}_{KEY}"], "val_acc": sel[f"{arm}_val_accuracy"], "trials": len(finished),
                  "epochs": epochs, "candidates": len(finished),
                  "margin_images": sel.get(f"{arm}_margin_images")} for arm in ARMS}  # fmt: skip
    return {"arms": arms, "trials": len(trials), "lrs": sorted(t[KEY] for t in trials),
            "rounds": len(bracket["rounds"]), "stop": bracket.get("stop"),
            "budget": 2 * sum(int(t["finetune_epochs"]) for t in trials),
            "pretrain_keys": {t["pretrain_key"] for t in trials}}  # fmt: skip


def search_result(sweep_dir: Path) -> dict[str, Any]:
    """Per arm: the chosen lr and its validation accuracy (chosen.json) and the epochs its trials trained
    (search.parquet), checked against metrics.json's search_epochs_trained."""
    chosen = json.loads((sweep_dir / "chosen.json").read_text())
    rows = _rows(sweep_dir / "search.parquet")
    metrics = json.loads((sweep_dir / "metrics.json").read_text())
    arms = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        pick = chosen.get(arm) or {}
        arms[arm] = {"lr": pick.get(KEY), "val_acc": pick.get("val_acc"), "trials": len(mine),
                     "epochs": sum(int(r["epoch"]) for r in mine),
                     "stopped": sum(r["status"] == "stopped" for r in mine),
                     "candidates": pick.get("candidates", 0), "runner_up": pick.get("runner_up"),
                     "margin_images": pick.get("margin_images"), "tie": pick.get("tie")}  # fmt: skip
    total = sum(a["epochs"] for a in arms.values())
    if total != int(metrics["search_epochs_trained"]):
        sys.exit(f"benchmark: search.parquet sums to {total} epochs, metrics.json says "
                 f"{metrics['search_epochs_trained']}")  # fmt: skip
    spec = json.loads((sweep_dir / "sweep.json").read_text())
    return {"arms": arms, "trials": len(rows), "budget": int(metrics["search_epochs_budget"]),
            "lrs": sorted(r[KEY] for r in rows if r["arm"] == ARMS[0]),
            "pretrain_keys": {t["pretrain_key"] for t in spec["trials"].values()}}  # fmt: skip


def pretraining(storage: Path, grid: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
    """The pretraining both sweeps used: one key for both (else the comparison is not on one CNN), how many
    times it ran (its executions.jsonl) and its own wall time (its metrics.json)."""
    keys = grid["pretrain_keys"] | search["pretrain_keys"]
    if len(keys) != 1:
        sys.exit(f"benchmark: the sweeps did not share one pretraining: {sorted(keys)}")
    (key,) = keys
    root = storage / "pretrain" / key
    runs = len((root / "executions.jsonl").read_text().splitlines())
    wall = json.loads((root / "runs" / "pretrain" / "metrics.json").read_text()).get("wall_s")
    return {"key": key, "runs": runs, "wall_s": wall}


# -------------------------------------------------------------------------------------------- the table


def _lr(v: Any) -> str:
    return "none" if v is None else f"{v:.3g}"


def _pct(v: Any) -> str:
    return "" if v is None else f"{100 * v:.2f}"


def _load(v: tuple[float, ...]) -> str:
    return ", ".join(f"{x:.2f}" for x in v)


def table(grid: dict[str, Any], search: dict[str, Any], walls: dict[str, float], batch: int) -> list[str]:
    lines = [f"| method | arm | chosen finetune.lr (at batch 1024; x{batch}/1024 applied) | validation accuracy (%) "
             "| trials | candidates (trained every epoch) | lead over the runner-up (validation images) "
             "| fine-tuning epochs trained |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for method, res in (("grid + bracketing", grid), ("ASHA + random search", search)):
        for arm in ARMS:
            a = res["arms"][arm]
            stopped = f" ({a['stopped']} stopped by ASHA)" if "stopped" in a else ""
            lead = (
                ""
                if a.get("margin_images") is None
                else f"{a['margin_images']}" + (" (tie)" if a.get("tie") else "")
            )
            lines.append(f"| {method} | {arm} | {_lr(a['lr'])} | {_pct(a['val_acc'])} | {a['trials']}{stopped} "
                         f"| {a['candidates']} | {lead} | {a['epochs']} |")  # fmt: skip
    lines += ["", "| method | fine-tuning epochs trained, both arms | of a budget without stopping | lrs tried "
              "| wall time (s) |", "|---|---:|---:|---|---:|"]  # fmt: skip
    for method, res, name in (
        ("grid + bracketing", grid, "grid"),
        ("ASHA + random search", search, "search"),
    ):
        used = sum(a["epochs"] for a in res["arms"].values())
        lrs = ", ".join(_lr(v) for v in res["lrs"])
        lines.append(f"| {method} | {used} | {res['budget']} | {lrs} | {walls[name]:.0f} |")
    return lines


def report(p: dict[str, Any], grid: dict[str, Any], search: dict[str, Any], walls: dict[str, float],
           pre: dict[str, Any], argv: list[str], load: dict[str, tuple[float, ...]]) -> str:  # fmt: skip
    from core.utils.machine import cpu_model

    pre_text = f"key {pre['key']}, run {pre['runs']} time(s), {pre['wall_s']:.0f} s"
    lines = [
        f"# ASHA + random search vs bracketed grid over finetune.lr ({cpu_model()}, {os.cpu_count()} cores)",
        "",
        f"Command: `{shlex.join(['.venv/bin/python', 'benchmarks/search_vs_grid.py', *argv])}`, which ran, in "
        "one work directory, one after the other:",
        "",
        *[f"- `{shlex.join(sweep_cmd(Path(f'{n}.yaml'), n))}`" for n in ("grid", "search")],
        "",
        f"Problem: Fashion-MNIST, the first {p['n_train'] + p['n_val']} training images ({p['n_val']} held out "
        f"for validation, data.val_size) and the first {p['n_test']} test images; {p['arch']} pretrained "
        f"{p['pretrain_epochs']} epoch(s) (one shared pretraining, {pre_text}, run and timed inside the grid "
        f"sweep), each arm fine-tuned {p['finetune_epochs']} epochs at batch {p['batch']}; CPU, 1 thread and "
        "1 CPU per trial, 2 trials at a time.",
        f"Grid: finetune.lr {GRID_LRS}, chosen per arm on validation accuracy, bracketing up to {BRACKET_ROUNDS} "
        f"rounds ({grid['rounds']} ran; stop: {grid['stop']}). Search: random, {p['points']} points x 2 arms over "
        f"finetune.lr ~ loguniform{SEARCH_RANGE}, seed 0, ASHA within each arm (grace period 1, reduction "
        "factor 2); each arm chooses among its trials that trained every epoch, at least "
        "sweep.search.min_finished (default 3) of them kept able to (ASHA's stop refused for a trial whose arm "
        "would keep fewer); the searcher values a point at the last epoch both its arms reached.",
        f"Load average (1, 5, 15 min) at the start: {_load(load['start'])}; at the end: {_load(load['end'])}.",
        "",
        *table(grid, search, walls, p["batch"]),
        "",
        "Read from each sweep's own outputs (grid: selected.parquet, summary.parquet, bracket.json; search: "
        "chosen.json, search.parquet, metrics.json). Wall time is each `tcnn sweep` process's: the grid's "
        "includes the shared pretraining and its trials' evaluate stage (clean test set and "
        f"{len(ROBUSTNESS['corruptions'])} corrupted set of {ROBUSTNESS['n_images']} images), which search trials "
        "do not run. One run on one shared CPU: the numbers are one draw, not a distribution.",
    ]
    return "\n".join(lines) + "\n"


def cpu_slug() -> str:
    from core.utils.machine import cpu_model

    return re.sub(r"[^a-z0-9]+", "_", cpu_model().lower()).strip("_") or "cpu"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--workdir", type=Path, default=None, help="default: a temporary directory, removed after"
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--quick", action="store_true", help="a tiny problem, to check the script")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else PROBLEM
    root = args.workdir or Path(tempfile.mkdtemp(prefix="tcnn-bench-search-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        files = make_project(root, p)
        load = {"start": os.getloadavg()}
        walls = {name: run(root, files[name], name) for name in ("grid", "search")}
        load["end"] = os.getloadavg()
        storage = root / "sweeps"
        grid, search = grid_result(storage / "grid"), search_result(storage / "search")
        text = report(p, grid, search, walls, pretraining(storage, grid, search), argv, load)
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(text, flush=True)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
