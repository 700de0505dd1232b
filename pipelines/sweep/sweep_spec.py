"""The spec a sweep runs from: the params validated and planned (pipelines/sweep/plan.py) plus what the driver
and its trials need (tracking, resources, selection and bracketing settings), all JSON-able; saved as
``<sweep>/sweep.json`` and reconciled with it on ``--resume`` / ``--auto-resume``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from core.utils.output_paths import OutputPathError, check_output_dir
from pipelines.sweep.plan import (
    SweepError,
    check_name,
    default_name,
    has_control,
    make_plan,
    plan_device,
    plan_spec,
    spec_difference,
)
from pipelines.sweep.sweep_params import SweepParams

SWEEP_JSON = "sweep.json"


def tracking_enabled(params: SweepParams) -> bool:
    """``tracking.enabled``, unless ``TCNN_TRACKING=0`` switches it off (as for the stages)."""
    return params.tracking.enabled and os.environ.get("TCNN_TRACKING") != "0"


def _check_published_sets(params: SweepParams, cwd: Path) -> None:
    """A published benchmark (``robustness.public``) checked from its files before Ray starts, as dvc.yaml's
    check stage does before pretraining (stages.published_check): a sweep never reaches evaluate to find it
    unreadable."""
    if params.robustness.public is None:
        return
    from stages.harness.runner import StageError
    from stages.published_check import check_public_before_training

    try:
        check_public_before_training(params, Path(os.path.relpath(cwd)))  # the files named as the user does
    except StageError as err:
        raise SweepError(str(err)) from None


def build_spec(
    params: SweepParams,
    *,
    name: str | None,
    params_file: Path,
    cwd: Path | None = None,
    placement: str = "pack",
) -> dict:
    """Validate and plan the sweep; the returned spec is all a driver and its trials need (JSON-able).
    ``placement``: how Ray places a trial's data-parallel workers (pipelines.ddp.PLACEMENTS)."""
    from stages.tracking.names import resolve_uri

    cwd = Path(cwd or Path.cwd()).resolve()
    sw = params.sweep
    try:  # where every sweep writes, checked before Ray starts (core.utils.output_paths)
        check_output_dir(cwd / sw.storage, "sweep.storage")
    except OutputPathError as err:
        raise SweepError(str(err)) from None
    _check_published_sets(params, cwd)
    uri = resolve_uri(params.tracking.uri, cwd)
    plan = make_plan(params, cwd=cwd, device=plan_device(params), tracking_uri=uri)
    name = check_name(name or default_name(params_file, params))
    if sw.search is not None and not has_control(plan.trials[0].params):
        raise SweepError("sweep.search: both arms are searched alike, and this model kind or finetune.control: "
                         "false has no matched control")  # fmt: skip
    spec = plan_spec(plan, name=name, share_pretraining=sw.share_pretraining)
    spec.update(
        {
            "tracking": {
                "enabled": tracking_enabled(params),
                "uri": uri,
                "experiment": params.tracking.experiment,
                "parent_run_id": None,
            },
            **trial_resources(params),
            "select": sw.select.model_dump(mode="json"),
            "bracket": _bracket_settings(params),
            "bracket_rounds": [],
            "cwd": str(cwd),  # where relative paths resolve when bracketing plans more trials
            "max_failures": sw.max_failures,
            "search": sw.search.model_dump(mode="json") if sw.search is not None else None,
            "scheduler": sw.scheduler.model_dump(mode="json") if sw.scheduler is not None else None,
            "placement": placement,
            "uid": None,
        }
    )
    return spec


def _bracket_settings(params: SweepParams) -> dict[str, Any] | None:
    """``sweep.select.bracket`` as the driver uses it (pipelines/sweep/bracket.py): key, ratio, bound."""
    from pipelines.sweep.settings import BracketPlan, bracket_key, log_step

    sel = params.sweep.select
    key = bracket_key(sel)
    ratio = None if key is None else log_step(params.sweep.grid[key])
    if key is None or sel.bracket is None or ratio is None:  # validation refused these already
        return None
    return BracketPlan(key=key, ratio=ratio, max_rounds=sel.bracket.max_rounds).model_dump(mode="json")


def trial_resources(params: SweepParams) -> dict[str, Any]:
    """Ray resources of a trial. With ``workers_per_trial`` W > 1 its stages run as Ray Train workers (W for
    training, one for reparam and evaluate: pipelines/ddp.py), each holding 1/W of ``sweep.cpus_per_trial`` /
    ``gpus_per_trial``; the trial process (the TorchTrainer driver, the corrupted sets) holds one more CPU
    share and no GPU: (W + 1) / W of the CPUs and exactly the GPUs asked for."""
    sw, w = params.sweep, params.workers_per_trial
    share = {"cpu": sw.cpus_per_trial / w, "gpu": sw.gpus_per_trial / w}
    return {
        "resources": share if w == 1 else {"cpu": share["cpu"], "gpu": 0.0},
        "workers": w,
        "worker_resources": share,
        "threads": max(1, int(share["cpu"])),
    }


def load_saved(spec: dict) -> dict | None:
    path = Path(spec["sweep_dir"]) / SWEEP_JSON
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise SweepError(
            f"{path}: unreadable sweep state; remove the sweep directory to start over"
        ) from None


def reconcile(spec: dict, resume: str) -> dict:
    """``resume``: "no" (the sweep must not exist), "yes" (it must), "auto". Returns the spec to run."""
    saved = load_saved(spec)
    where = spec["sweep_dir"]
    if saved is None:
        if resume == "yes":
            raise SweepError(f"--resume: no sweep {spec['name']!r} in {where} (drop --resume to start it)")
        return spec
    if resume == "no":
        raise SweepError(
            f"sweep {spec['name']!r} exists in {where}: pass --resume to continue it, or --name for a new one"
        )
    from pipelines.sweep.bracket import asked

    diff = spec_difference(asked(saved), asked(spec))  # the trials bracketing added are the sweep's own
    if diff is not None:
        raise SweepError(
            f"--resume: the params differ from those sweep {spec['name']!r} started with: {diff}"
        )
    merged = dict(saved)
    merged["tracking"] = {**spec["tracking"], "parent_run_id": saved.get("tracking", {}).get("parent_run_id")}
    merged["placement"] = spec.get("placement", "pack")  # where workers go does not change results
    merged["records"] = spec.get("records")  # trials recorded elsewhere, replayed (pipelines.sweep.replay)
    # How the results are chosen and bracketed is the params' of this run (a larger max_rounds goes on).
    merged |= {
        "select": spec["select"],
        "bracket": spec.get("bracket"),
        "cwd": saved.get("cwd", spec.get("cwd")),
    }
    return merged


def check_resources(spec: dict, nodes: list[dict[str, float]], where: str) -> None:
    """Refuse, before any compute, a trial no node can hold: Ray would otherwise keep it pending for ever
    (printing its insufficient-resources warning) after the driver has built the shared inputs. ``nodes``: the
    CPUs and GPUs of each node (Ray's ``CPU`` / ``GPU`` resources: the cluster the driver connected to, or what
    the SLURM job asks for per node); ``where`` names them in the line. A trial is its own process (``resources``)
    plus, with ``workers_per_trial`` W > 1, W Ray Train workers (``worker_resources`` each): each must fit a
    node, and all of them the whole cluster (one worker per node with ``strict_spread``)."""
    trial, worker, w = (
        spec["resources"],
        spec.get("worker_resources", spec["resources"]),
        spec.get("workers", 1),
    )
    bundles = [trial] + ([worker] * w if w > 1 else [])
    have = [{"cpu": float(n.get("CPU", 0.0)), "gpu": float(n.get("GPU", 0.0))} for n in nodes]
    shape = ", ".join(f"{h['cpu']:g} CPU / {h['gpu']:g} GPU" for h in have) or "none"
    key = {"cpu": "sweep.cpus_per_trial", "gpu": "sweep.gpus_per_trial"}
    for kind in ("gpu", "cpu"):
        need = max(b[kind] for b in bundles)
        if need > 0 and not any(h[kind] >= need - 1e-9 for h in have):
            raise SweepError(f"{key[kind]}: a trial needs {need:g} {kind.upper()} on one node, and no node of "
                             f"{where} has that many (nodes: {shape}); lower it or add such a node")  # fmt: skip
        total = sum(b[kind] for b in bundles)
        if total > sum(h[kind] for h in have) + 1e-9:
            raise SweepError(f"{key[kind]}: a trial asks for {total:g} {kind.upper()} in all (workers_per_trial="
                             f"{w}), more than {where} has (nodes: {shape})")  # fmt: skip
    if w > 1 and spec.get("placement") == "strict_spread":
        fit = sum(all(h[k] >= worker[k] - 1e-9 for k in ("cpu", "gpu")) for h in have)
        if fit < w:
            raise SweepError(f"--worker-placement strict_spread: a trial's {w} workers need {w} nodes that hold "
                             f"one each, {where} has {fit} (nodes: {shape})")  # fmt: skip
