"""Bracketing: the grid of a selected key grows until every arm's choice is interior (``sweep.select.bracket``).

"The best lr" of a grid whose best value is its largest only says that the largest value tried was best. With
``sweep.select: {over: [finetune.lr], bracket: {key: finetune.lr, max_rounds: 3}}`` (or ``bracket: true``:
the one key of ``over``, 3 rounds) the sweep driver, once the asked trials have run, applies the selection
itself (:func:`pipelines.sweep.selection.choose`: per configuration of the other grid keys, per seed, per arm,
the validation argmax; the test split is never read) and looks at every choice:

- a choice at the largest value of the key's grid adds ``largest * ratio``; a choice at the smallest adds
  ``smallest / ratio`` (``ratio``: the grid's constant ratio, :func:`pipelines.sweep.settings.log_step`); both can be
  added in one round. Any arm (T-CNN or control), any seed, any configuration counts: every choice the
  selection reports ends up interior, or the report says which is not;
- the new values' trials (every combination of the other grid keys) run, existing trials are reused as they
  are (same ids, directories and MLflow runs; new trials are numbered after them), and the rule applies again;
- it stops when every choice is interior, after ``max_rounds`` rounds ("still at the edge after N rounds"),
  or when the next value is not a valid setting (or not an integer, for an integer grid).

The rounds are kept in sweep.json (``bracket_rounds``: the values added, why, their trials), so a resumed
driver finishes a round it had started and then goes on with the rule. Reported in ``bracket.json``, the
``bracket_round`` column of summary.parquet (0: the asked grid), ``selected.md``, the report, the printed
summary and the MLflow parent run (tags ``tcnn.bracket.added`` and ``tcnn.bracket.stop``, metric
``bracket_rounds``). The parent's ``grid.*`` params stay the grid that was asked for.

:func:`decide` (pure) is the rule; :func:`extend` (no Ray) plans the added trials; the driver
(pipelines/sweep/driver.py) runs the rounds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.sweep.selection import ARMS, SEED, choose
from pipelines.sweep.settings import BracketPlan, SelectConfig, bracket_of

SIDES = ("bottom", "top")  # the order of the added values and their reasons


@dataclass(frozen=True)
class Step:
    """What one application of the rule says: values to add (and why), or why bracketing stops."""

    add: list[float | int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # one line per added value
    stop: str | None = None  # None: values were added


def settings(spec: dict[str, Any]) -> BracketPlan | None:
    """The bracketing plan the driver stores in the spec (key, ratio, max_rounds), or None."""
    return bracket_of(spec)


def _fmt(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _seeds(seeds: list[Any]) -> str:
    known = sorted(s for s in seeds if s is not None)
    if not known:
        return ""
    return f" for seed{'s' if len(known) > 1 else ''} {', '.join(str(s) for s in known)}"


def edges(picks: list[dict[str, Any]], key: str, values: list[Any]) -> dict[str, list[str]]:
    """The choices at the grid's edges, as sentences per side: "tcnn's choice 0.01 was the top edge for
    seeds 0, 2" (with the configuration when the grid has other keys)."""
    low, high = min(values), max(values)
    at: dict[tuple[str, str, str], list[Any]] = {}
    for p in picks:
        side = "top" if p[key] == high else "bottom" if p[key] == low else None
        if side is not None:
            at.setdefault((side, p["arm"], p["config"]), []).append(p.get(SEED))
    out: dict[str, list[str]] = {s: [] for s in SIDES}
    for side in SIDES:
        edge = high if side == "top" else low
        for arm in ARMS:
            for (s, a, config), seeds in at.items():
                if (s, a) == (side, arm):
                    where = "" if config == "(base config)" else f" ({config})"
                    out[side].append(f"{arm}'s choice {_fmt(edge)}{where} was the {side} edge{_seeds(seeds)}")
    return out


def beyond(value: float | int, ratio: float, up: bool, integer: bool) -> float | int | None:
    """One log step beyond ``value`` (12 significant digits); None when an integer grid has no integer there."""
    x = float(f"{(value * ratio if up else value / ratio):.12g}")
    if not integer:
        return x
    return int(round(x)) if abs(x - round(x)) < 1e-9 and round(x) > 0 else None


def decide(
    rows: list[dict[str, Any]],
    grid_keys: list[str],
    select: SelectConfig,
    bracket: BracketPlan,
    rounds_done: int,
) -> Step:
    """The rule on the summary ``rows`` of every trial so far (``<arm>_<by>`` scores, ``status``, grid values):
    values of ``bracket.key`` to add, with reasons, or why bracketing stops. Only validation scores are
    read (:func:`pipelines.sweep.selection.choose`, the selection's own rule)."""
    key, ratio, bound = bracket.key, bracket.ratio, bracket.max_rounds
    values = sorted({r[key] for r in rows if r.get(key) is not None})
    done = [r for r in rows if r.get("status") == "finished"]
    picks = choose(done, grid_keys, list(select.over), select.by)
    if not picks:
        return Step(stop=f"{key}: no finished trial to choose from; nothing added")
    at = edges(picks, key, values)
    if not any(at.values()):
        after = f" after {rounds_done} round{'s' if rounds_done != 1 else ''}" if rounds_done else ""
        tried = ", ".join(_fmt(v) for v in values)
        return Step(stop=f"{key}: every arm's choice is interior{after} (tried {tried})")
    if rounds_done >= bound:
        return Step(stop=f"{key}: still at the edge after {rounds_done} round{'s' if rounds_done != 1 else ''} "
                         f"(max_rounds {bound}): " + "; ".join(at["bottom"] + at["top"]))  # fmt: skip
    integer = all(isinstance(v, int) for v in values)
    add, reasons, blocked = [], [], []
    for side in SIDES:
        if not at[side]:
            continue
        edge = values[-1] if side == "top" else values[0]
        new = beyond(edge, ratio, side == "top", integer)
        if new is None:
            blocked.append(f"no integer {key} one step beyond {_fmt(edge)}: " + "; ".join(at[side]))
            continue
        add.append(new)
        reasons.append(f"{key}={_fmt(new)} added: " + "; ".join(at[side]))
    if not add:
        return Step(stop=f"{key}: still at the edge, " + "; ".join(blocked))
    return Step(add=add, reasons=reasons)


def rounds(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The rounds added so far: [{"round", "key", "added", "reasons", "trials"}], in order."""
    return list(spec.get("bracket_rounds") or [])


def round_of(spec: dict[str, Any]) -> dict[str, int]:
    """trial id -> the round that added it (the asked trials are round 0)."""
    added = {tid: r["round"] for r in rounds(spec) for tid in r["trials"]}
    return {tid: added.get(tid, 0) for tid in spec["trials"]}


def round_trials(spec: dict[str, Any], k: int) -> list[str]:
    """The trials of round ``k`` (0: those the grid asked for), in spec order."""
    return [tid for tid, r in round_of(spec).items() if r == k]


def asked(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec without the trials bracketing added (what the params alone plan; for resume checks)."""
    keep = set(round_trials(spec, 0))
    return {**spec, "trials": {tid: t for tid, t in spec["trials"].items() if tid in keep}}


def extend(spec: dict[str, Any], step: Step) -> tuple[dict[str, Any], list[str]]:
    """The spec with the trials of ``step.add`` (every combination with the other grid keys) as a new round.

    The grid with the added values is planned as the sweep was (pipelines.sweep.plan.make_plan); trials that
    exist keep their ids and entries, new ones are numbered after the last trial, and the shared pretraining
    groups, matched controls and corrupted sets gain the new trials (or are new). Raises SweepError when
    an added value is not a valid setting."""
    from core.utils.hashing import stable_hash
    from pipelines.sweep.plan import SweepError, make_plan, plan_device, plan_spec, trial_id
    from pipelines.sweep.sweep_params import validate_sweep_params

    plan = bracket_of(spec)
    if plan is None:
        raise SweepError("bracketing: the spec holds no sweep.select.bracket")
    key = plan.key
    values = sorted({t["overrides"][key] for t in spec["trials"].values()} | set(step.add))
    base = validate_sweep_params(spec["base"])
    try:
        base = base.with_overrides({"sweep.grid": {**spec["grid"], key: values}})
    except ValueError as err:  # ConfigError
        raise SweepError(str(err)) from None
    cwd = Path(spec.get("cwd") or Path.cwd())
    plan = make_plan(base, cwd=cwd, device=plan_device(base), tracking_uri=spec["tracking"]["uri"])
    new = plan_spec(plan, name=spec["name"], share_pretraining=spec["share_pretraining"])
    have = {stable_hash(t["overrides"]): tid for tid, t in spec["trials"].items()}
    out, ids, added = copy.deepcopy(spec), {}, []
    for ntid, t in new["trials"].items():
        tid = have.get(stable_hash(t["overrides"]))
        if tid is None:
            index = len(out["trials"])
            tid = trial_id(index, t["overrides"])
            out["trials"][tid] = {**t, "index": index}
            added.append(tid)
        ids[ntid] = tid
    for part in ("groups", "controls"):
        for k, entry in new[part].items():
            mine = [ids[x] for x in entry["trials"] if ids[x] in added]
            old = out[part].get(k)
            if old is not None and set(entry.get("epochs", [])) <= set(old.get("epochs", [])):
                old["trials"] = [*old["trials"], *mine]
            elif mine or old is None:  # new, or its trials now need more pretraining checkpoints
                out[part][k] = {**entry, "trials": [ids[x] for x in entry["trials"]]}
    for k, p in new["corrupt"].items():
        out["corrupt"].setdefault(k, p)
    k = len(rounds(out)) + 1
    out["bracket_rounds"] = [*rounds(out), {"round": k, "key": key, "added": list(step.add),
                                             "reasons": list(step.reasons), "trials": added}]  # fmt: skip
    return out, added


def notes(spec: dict[str, Any]) -> list[str]:
    """The lines that report bracketing: each round's additions and why it stopped."""
    out = [f"round {r['round']}: {why}" for r in rounds(spec) for why in r["reasons"]]
    if spec.get("bracket_stop"):
        out.append(spec["bracket_stop"])
    return out


def record(spec: dict[str, Any]) -> dict[str, Any]:
    """bracket.json: the settings, the rounds (values added, why, their trials) and why it stopped."""
    plan = settings(spec)
    return {"settings": None if plan is None else plan.model_dump(mode="json"), "rounds": rounds(spec),
            "stop": spec.get("bracket_stop")}  # fmt: skip


#: MLflow tag values are capped (8,000 characters in MLflow 3); bracket.json holds the whole text.
TAG_CHARS = 5000


def tags(spec: dict[str, Any]) -> dict[str, str]:
    """The parent run's tags: ``tcnn.bracket.added`` (each added value and why) and ``tcnn.bracket.stop``."""
    added = "; ".join(f"round {r['round']}: {why}" for r in rounds(spec) for why in r["reasons"]) or "none"
    out = {"tcnn.bracket.added": added}
    if spec.get("bracket_stop"):
        out["tcnn.bracket.stop"] = spec["bracket_stop"]
    return {
        k: v if len(v) <= TAG_CHARS else v[: TAG_CHARS - 20] + " ... (bracket.json)" for k, v in out.items()
    }
