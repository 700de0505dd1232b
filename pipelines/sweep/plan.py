"""Sweep planning: grid expansion, per-trial params, shared-pretraining groups and corrupted-set keys.

Pure functions (no Ray, no MLflow): the driver plans the whole sweep before anything runs, so bad input
fails with one line and nothing written, and every trial (on any node) finds its plan in the spec.

Shared work (issue 7): trials whose pretraining has the same identity -- the pretrain stage's own
(`stages.pretrain.identity`: seed, data content and meaning, the network pretraining builds, the pretrain
section minus which epochs are kept, the device, the stage's code and the network code dvc.yaml does not
list, e.g. a user's builder) -- form one *group*. A group pretrains
once, in the content-addressed directory ``<storage>/pretrain/<key>/`` (`stages.harness.identity.key`), keeping a
checkpoint at every t1 its trials ask for; later sweeps with the same identity reuse it. Matched controls
(`stages.finetune.identity`) and corrupted sets (`stages.corrupt.identity`) are shared the same way: the
identity a stage's DVC-path resume checks is the one that names its shared directory.

Fraction sweeps ([ConViT21] Table 2): with ``data.fraction_scales_epochs`` a trial at sample fraction f < 1
trains E' = max(1, round(E / f)) epochs in every phase, so it sees as many images as the f = 1 run; t1 keeps
its place in the schedule (`core.config.plan_epochs`, the same function the DVC stages apply). The summary
table shows the grid value and the effective epochs.
"""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.config import ConfigError, plan_epochs
from core.data import manifest_fingerprint
from core.models.builders import is_builder
from core.utils.hashing import stable_hash
from pipelines.sweep.sweep_params import SweepParams, validate_sweep_params
from stages.harness.identity import key as identity_key

PLAN_VERSION = 1
SHORT = {
    "reparam.epoch": "t1",
    "reparam.alpha_init": "alpha",
    "reparam.lambda_init": "lambda",
    "reparam.stride_mode": "stride_mode",
    "data.sample_fraction": "f",
    "model.kind": "kind",
    "seed": "seed",
}


class SweepError(ValueError):
    """Bad sweep input or state (one line naming the key, file or sweep): exit 2."""


@dataclass(frozen=True)
class TrialPlan:
    index: int
    tid: str  # "t003-1a2b3c4d": index in the grid + hash of its values (a stable directory name)
    overrides: dict[str, Any]  # the grid values of this trial (dotted keys)
    params: SweepParams  # validated: overrides, fraction scaling, absolute paths, empty grid
    pretrain_key: str
    corrupt_key: str
    control_key: str | None = None  # the shared matched control (None: this trial has no control)


@dataclass(frozen=True)
class PretrainGroup:
    key: str
    params: SweepParams  # what stages.pretrain.run gets (root = the group's directory)
    epochs: list[int]  # every t1 the group's trials need
    trials: list[str]
    identity: dict[str, Any]


@dataclass
class SweepPlan:
    base: SweepParams
    grid: dict[str, list[Any]]
    storage: Path
    trials: list[TrialPlan]
    groups: dict[str, PretrainGroup]
    corrupt: dict[str, SweepParams] = field(default_factory=dict)
    controls: dict[str, dict[str, Any]] = field(default_factory=dict)  # key -> params, pretrain key, identity

    def trial(self, tid: str) -> TrialPlan:
        for t in self.trials:
            if t.tid == tid:
                return t
        raise KeyError(tid)


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The cartesian product of the grid, the first key varying slowest (YAML order)."""
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"sweep.grid.{key}: expected a non-empty list of values")
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def trial_id(index: int, overrides: dict[str, Any]) -> str:
    return f"t{index:03d}-{stable_hash(overrides)[:8]}"


def trial_label(overrides: dict[str, Any]) -> str:
    """``t1=2 alpha=0.5``: the grid values in short form, for progress lines and plots."""
    return " ".join(f"{SHORT.get(k, k)}={v}" for k, v in overrides.items()) or "(base config)"


def read_manifest(data_dir: Path) -> dict[str, Any]:
    from core.data import read_manifest as _read

    try:
        return _read(data_dir)
    except Exception as err:  # DataError, OSError: one line naming the file
        raise SweepError(f"data.dir: {err}") from None


def planned(params: SweepParams, what: str) -> SweepParams:
    """`core.config.plan_epochs` (the one epoch plan of the DVC path and the sweeps), errors as SweepError."""
    try:
        return plan_epochs(params)
    except ConfigError as err:
        raise SweepError(f"{what}: {err}") from None


def pretrain_identity(params: SweepParams, manifest: dict[str, Any], device: str) -> dict[str, Any]:
    """The shared pretraining's identity: the pretrain stage's own (`stages.pretrain.identity`), for the
    network the stage builds from this config and the data ``manifest`` names."""
    from stages import pretrain
    from stages.harness import pretraining

    num_classes, in_chans = int(manifest["num_classes"]), int(manifest["image_shape"][-1])
    spec = pretraining.model_spec(params, num_classes, in_chans)
    fingerprint = manifest_fingerprint(manifest)
    return pretrain.identity(params, spec, fingerprint, device, workers=params.workers_per_trial)


def control_identity(params: SweepParams, pretrain_key: str, device: str) -> dict[str, Any]:
    """The shared matched control's identity: the control stage's own (`stages.finetune.identity`, variant
    control), starting from its pretraining (by key) at t1. Trials that differ only in the
    reparameterization (alpha/lambda init, stride mode, tcnn vs psa on the same CNN) share one control."""
    from stages import control, finetune

    inputs = {"pretrain": pretrain_key, "t1": params.t1()}
    return finetune.identity(params.for_control(), inputs, device, freeze=params.finetune.freeze,
                             variant=control.VARIANT.name, workers=params.workers_per_trial)  # fmt: skip


def corrupt_identity(params: SweepParams, manifest: dict[str, Any]) -> dict[str, Any]:
    """The shared corrupted sets' identity: the corrupt stage's own (`stages.corrupt.identity`)."""
    from stages import corrupt

    return corrupt.identity(params, manifest)


def _override(params: SweepParams, overrides: dict[str, Any], what: str) -> SweepParams:
    try:
        return params.with_overrides(overrides)
    except ConfigError as err:
        raise SweepError(f"{what}: {err}") from None


def plan_device(params: SweepParams) -> str:
    """The device the trials' identities name: cuda when the sweep gives trials GPUs."""
    return "cuda" if params.sweep.gpus_per_trial > 0 else "cpu"


def make_plan(
    base: SweepParams,
    *,
    cwd: Path | None = None,
    device: str = "cpu",
    tracking_uri: str | None = None,
) -> SweepPlan:
    """Expand ``base.sweep.grid`` into trials and group them by pretraining inputs.

    Paths (data.dir, sweep.storage) resolve against ``cwd`` (the directory `tcnn sweep` runs in); each
    trial's robustness.dir is the shared corrupted-set directory of its corrupt key.
    """
    cwd = Path(cwd or Path.cwd()).resolve()
    base = _absolute_inputs(base, cwd)
    grid = dict(base.sweep.grid)
    bad = [k for k in grid if k.split(".")[0] in ("sweep", "tracking")]
    if bad:
        raise SweepError(f"sweep.grid.{bad[0]}: sweep.* and tracking.* settings cannot vary within a sweep")
    storage = (cwd / base.sweep.storage).resolve()
    # A trial is one point of the grid: no grid of its own, nothing to select.
    fixed: dict[str, Any] = {"sweep.grid": {}, "sweep.select.over": [], "sweep.select.bracket": None,
                             "sweep.storage": str(storage)}  # fmt: skip
    if tracking_uri is not None:
        fixed["tracking.uri"] = tracking_uri
    manifests: dict[Path, dict[str, Any]] = {}
    trials: list[TrialPlan] = []
    identities: dict[str, dict[str, Any]] = {}
    corrupt: dict[str, SweepParams] = {}
    controls: dict[str, dict[str, Any]] = {}
    for i, combo in enumerate(expand_grid(grid) if grid else [{}]):
        p, ident, pkey, ckey = _trial_params(
            base, combo, cwd=cwd, storage=storage, fixed=fixed, manifests=manifests, device=device
        )
        xkey = _add_control(controls, p, pkey, trial_id(i, combo), device) if has_control(p) else None
        trials.append(TrialPlan(i, trial_id(i, combo), combo, p, pkey, ckey, xkey))
        identities[pkey] = ident
        corrupt[ckey] = _all_sets(corrupt.get(ckey), p)
    return SweepPlan(base, grid, storage, trials, _groups(trials, identities), corrupt, controls)


def _absolute_inputs(base: SweepParams, cwd: Path) -> SweepParams:
    """``base`` with its input paths (model.code too, which holds a workspace builder) absolute against
    ``cwd``, and ``cwd`` on PYTHONPATH for a user's model builder: trials run in Ray workers whose working
    directory is not ours."""
    if base.data.source is not None:
        base = _override(base, {"data.source": str((cwd / base.data.source).resolve())}, "data.source")
    source = base.pretrain.source
    if source is not None and source.is_file:
        where = str((cwd / source.weights).resolve())
        base = _override(base, {"pretrain.source.weights": where}, "pretrain.source.weights")
    if is_builder(base.model.arch):  # a user's builder imports from the workspace, in the Ray workers too
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if str(cwd) not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([str(cwd), *filter(None, paths)])
    base = _override(base, {"model.code": str((cwd / base.model.code).resolve())}, "model.code")
    if base.robustness.public is not None:
        where = str((cwd / base.robustness.public.dir).resolve())
        base = _override(base, {"robustness.public.dir": where}, "robustness.public.dir")
    return base


def _trial_params(
    base: SweepParams,
    combo: dict[str, Any],
    *,
    cwd: Path,
    storage: Path,
    fixed: dict[str, Any],
    manifests: dict[Path, dict[str, Any]],
    device: str,
) -> tuple[SweepParams, dict[str, Any], str, str]:
    """One grid point's validated params (``fixed`` settings, absolute data.dir, planned epochs, its shared
    corrupted-set directory), its pretraining identity and key, and its corrupt key. ``manifests`` caches
    the data manifests read so far, by data directory."""
    label = f"sweep.grid ({trial_label(combo)})"
    p = _override(base, combo, label)
    data_dir = (cwd / p.data.dir).resolve()
    if data_dir not in manifests:
        manifests[data_dir] = read_manifest(data_dir)
    manifest = manifests[data_dir]
    p = _override(p, {**fixed, "data.dir": str(data_dir)}, label)
    p = planned(p, label)
    ident = pretrain_identity(p, manifest, device)
    pkey = identity_key(ident)
    ckey = identity_key(corrupt_identity(p, manifest))
    p = _override(p, {"robustness.dir": str(storage / "corrupt" / ckey)}, label)
    return p, ident, pkey, ckey


def _add_control(
    controls: dict[str, dict[str, Any]], p: SweepParams, pkey: str, tid: str, device: str
) -> str:
    """Add trial ``tid`` (params ``p``, pretraining ``pkey``) to its shared matched control in ``controls``
    (created by its first trial); returns the control's key."""
    xident = control_identity(p, pkey, device)
    xkey = identity_key(xident)
    controls.setdefault(xkey, {"params": p, "pretrain_key": pkey, "identity": xident, "trials": []})
    controls[xkey]["trials"].append(tid)
    return xkey


def _groups(trials: list[TrialPlan], identities: dict[str, dict[str, Any]]) -> dict[str, PretrainGroup]:
    """The pretraining groups of ``trials`` (by pretrain key, in order of their first trial)."""
    members: dict[str, list[TrialPlan]] = {}
    for t in trials:
        members.setdefault(t.pretrain_key, []).append(t)
    groups = {}
    for key, ts in members.items():
        # The group pretrains with its first trial's params, keeping a checkpoint at every t1 of its trials
        # (the other keys of those params do not change what pretraining computes: that is the key).
        epochs = sorted({t.params.t1() for t in ts})
        norm = {"pretrain.checkpoint_epochs": epochs, "reparam.epoch": epochs[0]}
        gp = _override(ts[0].params, norm, f"pretraining group {key}")
        groups[key] = PretrainGroup(key, gp, epochs, [t.tid for t in ts], identities[key])
    return groups


def _all_sets(have: SweepParams | None, params: SweepParams) -> SweepParams:
    """The corrupt params of a shared directory: the first trial's, asking for every corruption and severity
    any of its trials evaluates (the sets do not depend on the list: `stages.corrupt.identity`)."""
    if have is None:
        return params
    r, q = have.robustness, params.robustness
    union = {"robustness.corruptions": list(dict.fromkeys([*r.corruptions, *q.corruptions])),
             "robustness.severities": sorted({*r.severities, *q.severities})}  # fmt: skip
    return _override(have, union, "robustness (shared corrupted sets)")


def has_control(params: SweepParams) -> bool:
    from stages.control import disabled_reason

    return disabled_reason(params) is None


def default_name(params_file: Path, base: SweepParams) -> str:
    """``<params stem>-<hash of the config>``: the same command names the same sweep (so --resume finds it)."""
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(params_file).stem) or "sweep"
    dump = base.model_dump(mode="json")
    if dump["sweep"]["select"].get("bracket") is None:  # a later key: sweeps without it keep their names
        del dump["sweep"]["select"]["bracket"]
    return f"{stem}-{stable_hash(dump)[:8]}"


NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")


def shared_dirs() -> tuple[str, ...]:
    """The directories of shared work under ``sweep.storage`` (a sweep's own directory is its name); finetune:
    the finished T-CNN fine-tunings' index (pipelines.sweep.reuse.INDEX)."""
    from stages.cnn_evaluation import DIR

    return ("pretrain", "control", "corrupt", DIR, "finetune")


def check_name(name: str) -> str:
    if not NAME_RE.match(name) or name in shared_dirs():
        taken = " or ".join(repr(d) for d in shared_dirs())
        raise SweepError(f"--name {name!r}: use letters, digits, '_', '.', '-' (not {taken}), at most 100")
    return name


# ------------------------------------------------------------------------------------------ the spec


def plan_spec(plan: SweepPlan, *, name: str, share_pretraining: bool) -> dict[str, Any]:
    """The JSON-able description every trial reads (sweep.json holds it, so resumes use the same plan)."""
    return {
        "version": PLAN_VERSION,
        "name": name,
        "storage": str(plan.storage),
        "sweep_dir": str(plan.storage / name),
        "grid": plan.grid,
        "share_pretraining": share_pretraining,
        "base": plan.base.model_dump(mode="json"),
        "trials": {
            t.tid: {
                "index": t.index,
                "overrides": t.overrides,
                "params": t.params.model_dump(mode="json"),
                "pretrain_key": t.pretrain_key,
                "corrupt_key": t.corrupt_key,
                "control_key": t.control_key,
            }
            for t in plan.trials
        },
        "controls": {
            k: {
                "params": c["params"].model_dump(mode="json"),
                "pretrain_key": c["pretrain_key"],
                "trials": c["trials"],
                "identity": c["identity"],
            }
            for k, c in plan.controls.items()
        },
        "groups": {
            k: {
                "params": g.params.model_dump(mode="json"),
                "epochs": g.epochs,
                "trials": g.trials,
                "identity": g.identity,
            }
            for k, g in plan.groups.items()
        },
        "corrupt": {k: p.model_dump(mode="json") for k, p in plan.corrupt.items()},
    }


def trial_params(spec: dict[str, Any], tid: str) -> SweepParams:
    return validate_sweep_params(spec["trials"][tid]["params"])


def spec_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first trial setting that differs between a saved sweep and the one asked for now (None: same)."""
    if list(old["trials"]) != list(new["trials"]):
        return "the grid (its trials differ)"
    for tid in old["trials"]:
        a, b = old["trials"][tid]["params"], new["trials"][tid]["params"]
        if a != b:
            flat_a, flat_b = _flat(a), _flat(b)
            for key in sorted(set(flat_a) | set(flat_b)):
                if flat_a.get(key) != flat_b.get(key):
                    return f"{key} ({flat_a.get(key)!r} -> {flat_b.get(key)!r})"
    if old.get("share_pretraining") != new.get("share_pretraining"):
        return "sweep.share_pretraining"
    return None


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}
