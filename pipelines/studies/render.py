"""The README section and the figures of a study, from its committed tables (results.py; ``tcnn study render``).

``render`` re-derives the selection from the grid rows (validation argmax per seed and arm; it must agree
with the selected rows), the over-seed t-intervals from the selected rows, draws the figures
(core.viz.study_plots) and writes the Markdown section; with ``--readme`` it replaces the block between
``<!-- study:<name>:begin -->`` and ``<!-- study:<name>:end -->`` (``--check``: exit 1 if it differs).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from core.utils.atomic import atomic_write_text
from pipelines.studies.results import ARMS, DIFF, ENDS, METRICS
from pipelines.studies.study_tables import StudyError, load


def reselect(rows: list[dict[str, Any]]) -> dict[tuple[int, str], float]:
    """The validation argmax per (seed, arm) over the grid rows (first in file order on ties)."""
    best: dict[tuple[int, str], tuple[float, float]] = {}
    for r in rows:
        if r["row"] != "grid":
            continue
        for arm in ARMS:
            v = r[f"{arm}_val_accuracy"]
            k = (r["seed"], arm)
            if k not in best or v > best[k][1]:
                best[k] = (r[f"{arm}_value"], v)
    return {k: v[0] for k, v in best.items()}


def selected(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The selected rows, checked against :func:`reselect`, as are the grid rows' ``<arm>_selected`` flags (a
    study whose table disagrees is refused)."""
    picks = reselect(rows)
    for r in rows:  # the grid rows' flags are what the counts in the README read
        if r["row"] != "grid":
            continue
        for arm in ARMS:
            if bool(r[f"{arm}_selected"]) != (picks.get((r["seed"], arm)) == r[f"{arm}_value"]):
                raise StudyError(
                    f"seed {r['seed']}, {arm} {r[f'{arm}_value']}: {arm}_selected is {r[f'{arm}_selected']}, "
                    f"but the validation argmax is {picks.get((r['seed'], arm))}"
                )
    out = [r for r in rows if r["row"] == "selected"]
    for r in out:
        for arm in ARMS:
            if picks.get((r["seed"], arm)) != r[f"{arm}_value"]:
                raise StudyError(
                    f"seed {r['seed']}: the {arm} row chose {r[f'{arm}_value']}, the validation argmax is "
                    f"{picks.get((r['seed'], arm))}"
                )
    return sorted(out, key=lambda r: r["seed"])


def _pp(v: float | None, sign: bool = False) -> str:
    return "-" if v is None else f"{100 * v:{'+' if sign else ''}.2f}"


def _ci(mean: Any, lo: Any, hi: Any, sign: bool = True) -> str:
    return f"{_pp(mean, sign)} [{_pp(lo, sign)}, {_pp(hi, sign)}]"


def headline(rows: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """T-CNN - control at the chosen values, mean over seeds with Student's 95% t-interval, per metric."""
    from core.robustness.intervals import t_interval

    sel = selected(rows)
    return {m: t_interval([r[f"{DIFF}_{m}"] for r in sel]) for m in METRICS}


def images_paragraph(
    meta: dict[str, Any], params_file: Path | None, shown: str = "the study's params"
) -> str:
    """Which images play which role in the study: the ``data_roles`` its trials recorded (core.data.split_roles)
    where meta.json has them, else what its params configure; the ``data`` and ``robustness`` sections exported
    with meta.json, else those of ``params_file`` (the study's preset, for tables exported before meta.json
    carried them, named ``shown``)."""
    cfg, source = _image_params(meta, params_file, shown)
    if cfg is None:
        return "Which images played which role was not recorded with these tables."
    data, rob = cfg
    roles = meta.get("data_roles")
    if roles:
        from core.data import roles_text, training_text

        told = (
            f"as the trials' fine-tuning recorded them (`data_roles`, `data.val_from: {roles['val_from']}`)"
        )
        split = f"{training_text(roles)}; {roles_text(roles)}"
        test_images: int | None = roles["test"]["images"]
    else:
        told = (f"as {source} configures them (the trials, at `{(meta.get('commit') or '?')[:12]}`, recorded "
                "no `data_roles`)")  # fmt: skip
        split = _configured_split(data)
        test_images = None
    return f"**Images**, {told}: {split}; {_sets_text(rob, test_images)}."


def _image_params(
    meta: dict[str, Any], params_file: Path | None, shown: str
) -> tuple[tuple[dict, Any] | None, str]:
    """(the study's data section, its validated robustness section) and where they were read."""
    from core.config import DataConfig, RobustnessConfig

    if meta.get("data") and meta.get("robustness"):
        raw, source = {"data": meta["data"], "robustness": meta["robustness"]}, "meta.json"
    elif params_file is not None and params_file.is_file():
        import yaml

        raw, source = yaml.safe_load(params_file.read_text()) or {}, f"`{shown}`"
    else:
        return None, ""
    # the defaults of the keys a study leaves out (the data section is not validated: its data need not be here)
    fields = DataConfig.model_fields
    data = {k: (raw.get("data") or {}).get(k, fields[k].default) for k in ("val_from", "val_size", "limit")}
    return (data, RobustnessConfig.model_validate(raw.get("robustness") or {})), source


def _configured_split(data: dict[str, Any]) -> str:
    if data["val_from"] == "test_half":
        return ("training: every training image; validation: the test split's class-balanced half of even "
                "ranks (core.data.half_split); test and corrupted sets: its other half")  # fmt: skip
    cap = f", capped by `data.limit` {data['limit']}" if data.get("limit") else ""
    return (f"training: the training split less the validation images{cap}; validation (each arm's lr): "
            f"{data['val_size']:,} training images (`data.val_size`), class-balanced, carved from the training "
            "split; test: the whole test split")  # fmt: skip


def _sets_text(rob: Any, test_images: int | None) -> str:
    """The corrupted sets: how many, and how many of the test role's images each holds."""
    n = len(rob.corruptions) * len(rob.severities)
    per = rob.n_images if test_images is None else min(rob.n_images, test_images)
    return (f"corrupted sets: {len(rob.corruptions)} corruptions x {len(rob.severities)} severities = {n} sets "
            f"of {per:,} of those test images each (`robustness.n_images`, stratified by class)")  # fmt: skip


def markdown(data: dict[str, Any], name: str, fig_dir: str, params_file: Path | None = None) -> str:
    """The README section (between the markers): the per-seed and over-seed table, the sentences, the grid
    table and the figures."""
    from pipelines.sweep.selection import verdict

    rows, meta = data["rows"], data["meta"]
    key = meta["selected_key"]
    sel = selected(rows)
    head = headline(rows)
    lines = [
        f"| seed | T-CNN {key} | control {key} | T-CNN val / test | control val / test | T-CNN - control clean (pp) "
        "| mCA T-CNN / control | T-CNN - control mCA (pp) | T-CNN - control mCE (pp) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sel:
        lines.append(
            f"| {r['seed']} | {r['tcnn_value']:g} | {r['control_value']:g} "
            f"| {_pp(r['tcnn_val_accuracy'])} / {_pp(r['tcnn_clean_accuracy'])} "
            f"| {_pp(r['control_val_accuracy'])} / {_pp(r['control_clean_accuracy'])} "
            f"| {_ci(*(r[f'{DIFF}_clean_accuracy{e}'] for e in ENDS))} "
            f"| {_pp(r['tcnn_mca'])} / {_pp(r['control_mca'])} "
            f"| {_ci(*(r[f'{DIFF}_mca{e}'] for e in ENDS))} | {_ci(*(r[f'{DIFF}_mce{e}'] for e in ENDS))} |"
        )
    from core.robustness.intervals import t_interval

    def mean(col: str) -> str:
        return _pp(t_interval([r[col] for r in sel])["mean"])

    h = {m: _ci(head[m]["mean"], head[m]["low"], head[m]["high"]) for m in METRICS}
    lines.append(
        f"| mean of {len(sel)} | | | {mean('tcnn_val_accuracy')} / {mean('tcnn_clean_accuracy')} "
        f"| {mean('control_val_accuracy')} / {mean('control_clean_accuracy')} | **{h['clean_accuracy']}** "
        f"| {mean('tcnn_mca')} / {mean('control_mca')} | **{h['mca']}** | **{h['mce']}** |"
    )
    says = {m: verdict(head[m]["mean"], head[m]["low"], head[m]["high"], lower_is_better=m.endswith("mce"))
            for m in METRICS}  # fmt: skip
    text = "\n".join(lines) + "\n\n"
    text += (
        f"Each arm at the {key} with the best validation accuracy of its seed; the test split only reports. "
        "Per seed: paired bootstrap 95% interval over test images; last row: mean over seeds with Student's "
        "95% t-interval. Accuracies in %, differences in percentage points; mCE is normalised by each seed's "
        "pretrained CNN (lower is better).\n\n"
        f"- Clean accuracy, T-CNN - control: {h['clean_accuracy']} pp: {says['clean_accuracy']}.\n"
        f"- Mean corruption accuracy, T-CNN - control: {h['mca']} pp: {says['mca']}.\n"
        f"- mCE, T-CNN - control: {h['mce']} pp: {says['mce']}.\n\n"
    )
    text += images_paragraph(meta, params_file, f"{fig_dir}.yaml") + "\n\n"
    text += _grid_table(rows, key) + "\n" + _plateau_sentence(data["history"], sel) + "\n\n"
    text += _heads_sentence(data["attention"]) + "\n\n"
    text += (
        f"![test accuracy and mCA against the fine-tuning lr, both arms]({fig_dir}/lr_grid.png)\n\n"
        f"![validation accuracy per fine-tuning epoch]({fig_dir}/val_curves.png)\n\n"
        f"![GPSA heads over fine-tuning]({fig_dir}/attention.png)\n\n"
        f"Generated by `tcnn study render {fig_dir}` from the committed tables; sweep `{meta['sweep']}` at commit "
        f"`{(meta.get('commit') or '?')[:12]}`: {meta.get('trials')} trials, {_hours(meta)} on "
        f"{' / '.join(meta.get('cpus') or ['an unrecorded CPU'])}.\n"
    )
    return text


def _hours(meta: dict[str, Any]) -> str:
    h = meta.get("compute_h")
    if h is None:
        return "compute time not recorded"
    return f"{h:.1f} h of compute (every kept training epoch plus the other stages' recorded time)"


def _grid_table(rows: list[dict[str, Any]], key: str) -> str:
    from core.robustness.intervals import t_interval

    grid = [r for r in rows if r["row"] == "grid"]
    values = sorted({r["tcnn_value"] for r in grid})
    lines = [f"| {key} | T-CNN val | control val | T-CNN test | control test | T-CNN mCA | control mCA "
             "| T-CNN - control clean (pp) | T-CNN - control mCA (pp) | chosen by (T-CNN / control) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for v in values:
        at = [r for r in grid if r["tcnn_value"] == v]

        def ci(col: str, sign: bool = False, at: list[dict[str, Any]] = at) -> str:
            t = t_interval([r[col] for r in at])
            return _ci(t["mean"], t["low"], t["high"], sign)

        n_t, n_c = sum(bool(r["tcnn_selected"]) for r in at), sum(bool(r["control_selected"]) for r in at)
        lines.append(
            f"| {v:g} | {ci('tcnn_val_accuracy')} | {ci('control_val_accuracy')} | {ci('tcnn_clean_accuracy')} "
            f"| {ci('control_clean_accuracy')} | {ci('tcnn_mca')} | {ci('control_mca')} "
            f"| {ci(f'{DIFF}_clean_accuracy', True)} | {ci(f'{DIFF}_mca', True)} | {n_t} / {n_c} seeds |"
        )
    return "The whole grid (mean over seeds [95% t-interval], %):\n\n" + "\n".join(lines) + "\n"


def _plateau_sentence(history: list[dict[str, Any]], sel: list[dict[str, Any]]) -> str:
    """Has validation accuracy stopped rising? Its change over the last fine-tuning epoch at each seed's chosen
    value, per arm (mean over seeds, in pp), next to the change over the first epoch."""
    parts = []
    for arm in ARMS:
        last, first = [], []
        for r in sel:
            curve = sorted((int(h["epoch"]), float(h["val_accuracy"])) for h in history
                           if h["arm"] == arm and int(h["seed"]) == int(r["seed"]) and h["value"] == r[f"{arm}_value"])  # fmt: skip
            if len(curve) >= 3:
                last.append(curve[-1][1] - curve[-2][1])
                first.append(curve[1][1] - curve[0][1])
        if last:
            name = "T-CNN" if arm == "tcnn" else "control"
            parts.append(f"{name} {100 * float(np.mean(last)):+.2f} pp in the last epoch (first: "
                         f"{100 * float(np.mean(first)):+.2f} pp)")  # fmt: skip
    if not parts:
        return "No fine-tuning history was recorded."
    return ("Validation accuracy at the chosen values, mean over seeds: " + "; ".join(parts) +
            " (figure `val_curves.png`: every epoch, every value).")  # fmt: skip


def _heads_sentence(attention: list[dict[str, Any]]) -> str:
    from core.viz.study_plots import CONTENT_GATE

    if not attention:
        return "No GPSA statistics were recorded."
    last = max(int(r["epoch"]) for r in attention)
    parts = []
    for seed in sorted({int(r["seed"]) for r in attention}):
        end = [r for r in attention if int(r["seed"]) == seed and int(r["epoch"]) == last]
        content = [r for r in end if float(r["gate"]) < CONTENT_GATE]
        gmin = min(end, key=lambda r: float(r["gate"]))
        parts.append(
            f"seed {seed}: {len(content)} of {len(end)} heads (lowest sigma(lambda) {float(gmin['gate']):.3f}, "
            f"{gmin['layer']} head {gmin['head']})"
        )
    return (
        f"Content-based heads (sigma(lambda) < {CONTENT_GATE}) at the end of fine-tuning, in each seed's chosen "
        "T-CNN: " + "; ".join(parts) + "."
    )


def with_block(text: str, name: str, section: str) -> str | None:
    """``text`` with the block between ``<!-- study:NAME:begin -->`` and its end marker replaced by ``section``;
    None when the markers are not there."""
    begin, end = f"<!-- study:{name}:begin -->", f"<!-- study:{name}:end -->"
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{section}{end}{rest.split(end, 1)[1]}"


def render(results: Path, readme: Path | None = None, *, check: bool = False) -> tuple[str, bool]:
    """Figures into ``results``, the Markdown section; with ``readme`` the block replaced (or compared).
    Returns (section, whether the README matched). The study's params are ``<results>.yaml`` next to the
    results folder (pipelines/studies/cifar10_lr.yaml for pipelines/studies/cifar10_lr) where meta.json does
    not carry them."""
    from core.utils.output_paths import check_output_dir, check_output_file
    from core.viz.study_plots import plot_head_gates, plot_lr_grid, plot_val_curves

    data = load(results)
    name = data["meta"]["sweep"]
    if not check:  # where the figures and the block go, before anything is drawn (core.utils.output_paths)
        check_output_dir(results, "results")
        if readme is not None:
            check_output_file(
                readme, "--readme", holds=(f"<!-- study:{name}:begin -->", f"<!-- study:{name}:end -->")
            )
    # the figures' links, relative to the README they go in (the same text from any working directory)
    fig_dir = Path(os.path.relpath(results, readme.parent)).as_posix() if readme else results.as_posix()
    section = markdown(data, name, fig_dir, params_file=results.parent / f"{results.name}.yaml")
    if not check:
        grid = [{**r, "lr": r["tcnn_value"]} for r in data["rows"] if r["row"] == "grid"]
        plot_lr_grid(grid, results / "lr_grid.png", title=name)
        plot_val_curves(
            [{**h, "lr": h["value"]} for h in data["history"]], results / "val_curves.png", title=name
        )
        if data["attention"]:
            plot_head_gates(data["attention"], results / "attention.png", title=name)
    if readme is None:
        return section, True
    text = readme.read_text()
    new = with_block(text, name, section)
    if new is None:
        raise StudyError(f"{readme}: no <!-- study:{name}:begin --> ... <!-- study:{name}:end --> block")
    same = new == text
    if not check and not same:
        atomic_write_text(readme, new)
    return section, same
