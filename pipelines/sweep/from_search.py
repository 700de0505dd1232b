"""``tcnn sweep --from-search NAME``: a finished search's choices (``<storage>/NAME/chosen.json``) as the params of
a grid, usually a grid of seeds at the chosen values (the search's answer measured with an interval).

Each arm keeps its own choice, as the search chose it on validation data (T-CNN, d'Ascoli et al. 2021: the
T-CNN and its matched control are fine-tuned from one CNN, each at its own best lr): ``finetune.lr`` = the
T-CNN's chosen lr and ``finetune.control_lr`` = the control's; the T-CNN-only keys (``reparam.*``,
``finetune.gate_lr``) take the T-CNN's values; a key both arms train with and only one param holds
(``finetune.weight_decay``, ``finetune.warmup_epochs``) is carried when both arms chose the same value, refused
otherwise. ``sweep.search`` and ``sweep.scheduler`` are removed; the user's ``-S`` (the seed grid) is kept.

Refused (one line, exit 2, before anything is written): no such sweep, a grid and not a search, a search not
finished (no chosen.json and metrics.json), an arm without a choice, an arm that chose among fewer than
``sweep.search.min_finished`` (default 3) distinct trials that trained every epoch (or than its distinct
configurations, where fewer) unless ``force``, a ``-S`` that sets a
key the search chose, a grid whose problem differs from the search's (any base param but the searched keys,
``sweep.*``, ``tracking.*`` and ``seed``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipelines.sweep.plan import SweepError, _flat
from pipelines.sweep.scheduling import ARMS

#: Searchable keys only the T-CNN has (the control has no attention, no gates).
TCNN_ONLY = ("reparam.", "finetune.gate_lr")
#: What a search's choice may differ in from the grid it becomes: the search's own settings and the tracking.
FREE = ("sweep.", "tracking.", "seed", "finetune.control_lr")
DEFAULT_MIN_FINISHED = 3


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError:
        raise SweepError(f"--from-search: {path}: unreadable") from None


def read_search(storage: Path, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The search ``name``'s spec (sweep.json) and choices (chosen.json); refused when it is missing, a grid,
    unfinished, or an arm has no choice."""
    where = Path(storage) / name
    spec = _read(where / "sweep.json")
    if spec is None:
        raise SweepError(f"--from-search {name}: no sweep {name!r} in {storage}")
    if not spec.get("search"):
        raise SweepError(f"--from-search {name}: {where} is a grid, not a search (sweep.search)")
    picks = _read(where / "chosen.json")
    if picks is None or _read(where / "metrics.json") is None:
        raise SweepError(f"--from-search {name}: the search has not finished (no chosen.json): run "
                         f"`tcnn sweep --name {name} --resume` to finish it")  # fmt: skip
    for arm in ARMS:
        if not picks.get(arm):
            raise SweepError(
                f"--from-search {name}: the {arm} arm chose nothing (no trial of it trained every epoch)"
            )
    return spec, picks


def candidates(storage: Path, name: str, picks: dict[str, Any], arm: str) -> int:
    """How many trials of ``arm`` the choice was made among: chosen.json's ``candidates`` where the search
    wrote it, else its finished trials counted in search.parquet (what scheduling.choose chooses among)."""
    n = picks[arm].get("candidates")
    if isinstance(n, int):
        return n
    import pyarrow.parquet as pq

    rows = pq.read_table(Path(storage) / name / "search.parquet", columns=["arm", "status"]).to_pylist()
    return sum(r["arm"] == arm and r["status"] == "finished" for r in rows)


def chosen_values(spec: dict[str, Any], picks: dict[str, Any]) -> dict[str, Any]:
    """The overrides that put each arm at its choice (module docstring), and the search keys removed."""
    out: dict[str, Any] = {}
    tcnn, control = picks["tcnn"], picks["control"]
    for key in spec["search"]["space"]:
        if key == "finetune.lr":
            out |= {"finetune.lr": tcnn[key], "finetune.control_lr": control[key]}
        elif key.startswith(TCNN_ONLY) or tcnn[key] == control[key]:
            out[key] = tcnn[key]
        else:
            raise SweepError(f"--from-search {spec['name']}: {key}: the arms chose {tcnn[key]!r} (tcnn) and "
                             f"{control[key]!r} (control), and one param holds it for both arms")  # fmt: skip
    return out | {"sweep.search": None, "sweep.scheduler": None}


def check_candidates(
    storage: Path, spec: dict[str, Any], picks: dict[str, Any], force: bool
) -> dict[str, int]:
    """Each arm's number of candidates; refused below ``sweep.search.min_finished`` unless ``force``, or below
    the distinct configurations the arm had (chosen.json's ``configs``) where that is fewer: a search over
    ``reparam.*`` keys alone gives its control arm one control to choose, whatever its number of points."""
    need = int(spec["search"].get("min_finished") or DEFAULT_MIN_FINISHED)
    counts = {arm: candidates(storage, spec["name"], picks, arm) for arm in ARMS}
    few = [f"{arm} {n}" for arm, n in counts.items() if n < min(need, picks[arm].get("configs") or need)]
    if few and not force:
        raise SweepError(f"--from-search {spec['name']}: an arm chose among fewer than {need} trials that trained "
                         f"every epoch ({', '.join(few)}): --force to use its choice anyway")  # fmt: skip
    return counts


def check_sets(name: str, sets: list[str], values: dict[str, Any]) -> None:
    """A ``-S`` may not set what the search chose."""
    for text in sets:
        key = text.split("=", 1)[0].strip()
        if key in values or any(key.startswith(f"{k}.") for k in values):
            raise SweepError(f"-S {key}: set by --from-search {name} (its chosen value); drop the -S")


def check_problem(search_spec: dict[str, Any], grid_spec: dict[str, Any]) -> None:
    """The grid's base params are the search's but for the searched keys, ``sweep.*``, ``tracking.*``, the
    seed and ``finetune.control_lr``: the choice was made on this problem."""
    searched = tuple(search_spec["search"]["space"])
    a, b = _flat(search_spec["base"]), _flat(grid_spec["base"])
    for key in sorted(set(a) | set(b)):
        if key.startswith(FREE) or key in searched:
            continue
        if a.get(key) != b.get(key):
            raise SweepError(f"--from-search {search_spec['name']}: {key} is {b.get(key)!r} here and was "
                             f"{a.get(key)!r} in the search: its choice was made on another problem")  # fmt: skip


def origin(
    storage: Path, name: str, sets: list[str], force: bool
) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """The overrides (``KEY=VALUE`` texts, applied before the user's ``-S``), the record kept in sweep.json
    (``from_search``) and the search's spec."""
    spec, picks = read_search(storage, name)
    values = chosen_values(spec, picks)
    counts = check_candidates(storage, spec, picks, force)
    check_sets(name, sets, values)
    record = {"name": name, "sweep_dir": str(Path(storage) / name), "values": values,
              "trials": {arm: picks[arm]["trial"] for arm in ARMS},
              "val_acc": {arm: picks[arm].get("val_acc") for arm in ARMS},
              "candidates": counts, "forced": bool(force)}  # fmt: skip
    return [f"{k}={_yaml(v)}" for k, v in values.items()], record, spec


def _yaml(value: Any) -> str:
    """A value as ``-S`` parses it back (YAML: ``1.0e-05``, not JSON's ``1e-05``, which YAML reads as text)."""
    import yaml

    return yaml.safe_dump(value, default_flow_style=True).split("\n...")[0].strip()


def line(record: dict[str, Any]) -> str:
    """One sentence naming the search a grid came from and each arm's choice (report.html, the printed end)."""
    vals = ", ".join(f"{k}={v}" for k, v in record["values"].items() if not k.startswith("sweep."))
    arms = "; ".join(
        f"{arm} {record['trials'][arm]} among {record['candidates'][arm]} candidates" for arm in ARMS
    )
    forced = " (forced below sweep.search.min_finished)" if record.get("forced") else ""
    return f"From search {record['name']} ({record['sweep_dir']}): {vals} ({arms}){forced}."
