"""A study run's block (`tcnn study run` writes it, `tcnn study render OUT` writes it again from the committed
files): the search's choice per arm and where it sits among the points that ran, the sequential rule, the answer
over seeds with a sentence per metric that claims a difference only where the interval excludes 0, and, from
the main seeds' trial records (pipelines.studies.seed_records), the interval over test images, the images'
roles and each arm's fine-tuning from its start."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from core.utils.atomic import atomic_write_text
from pipelines.sweep.plan import SweepError

KEY = "finetune.lr"
#: The trial records under a study's folder (`tcnn study snapshot`; replayed: pipelines.sweep.replay).
RECORDS = "trials"
STATE = "study.json"
ARMS = ("tcnn", "control")
MODELS = ("cnn", "control", "tcnn")  # the imported or pretrained CNN, its fine-tuned control, its T-CNN
#: The differences sized and reported: summary.parquet's per-arm columns (fractions) and their names.
SIZED = (("clean_accuracy", "clean accuracy"), ("mca", "mCA"))
REPORTED = (*SIZED, ("mce", "mCE"))  # mCE: reported with its interval, not sized


class StudyRunError(SweepError):
    """A study that cannot run as asked: one line, exit 2."""


def _pp(v: float | None, sign: bool = True) -> str:
    return (
        "n/a"
        if v is None or (isinstance(v, float) and math.isnan(v))
        else f"{100 * v:{'+' if sign else ''}.2f}"
    )


def sentence(res: dict[str, Any], unit: str) -> str:
    """What the interval says, in words (a difference is claimed only where the interval excludes 0; for mCE,
    lower is better)."""
    ci = f"{_pp(res['mean'])} pp, 95% CI [{_pp(res['low'])}, {_pp(res['high'])}] over {unit}"
    if res["sign"] == "spans":
        claim = f"no difference resolved ({ci})"
    else:
        better = (res["sign"] == "above") != bool(res.get("lower_is_better"))
        where = "above" if res["sign"] == "above" else "below"
        claim = f"the T-CNN is {where} its control, {'better' if better else 'worse'} ({ci})"
    width = "within" if res["resolved"] else "wider than"
    asked = f", {width} the +-0.5 pp asked" if res.get("sized", True) else " (not sized)"
    return f"{res['name']}: {claim}; half-width {100 * res['half_width']:.2f} pp{asked}."


def _edge(search: dict[str, Any], arm: str) -> str:
    """The choice at the edge of the points the search ran: the best lr may lie beyond them."""
    side = (search.get("edges") or {}).get(arm)
    if side is None:
        return ""
    lo, hi = next(iter(search["space"].values()))
    bound, which = (hi, "largest") if side == "above" else (lo, "smallest")
    lr = search["choice"][arm]["lr"]
    span = f"({lr:.3g}, {bound:g}]" if side == "above" else f"[{bound:g}, {lr:.3g})"
    return f"; the {which} lr the search ran, so the best may lie {side} it (no point ran in {span})"


def _ran(search: dict[str, Any], arm: str) -> str:
    """Every point the arm's search ran (lr at batch 1024: validation accuracy), on a line of its own."""
    ran = (search.get("ran") or {}).get(arm)
    return f"\n     - every point it ran (lr: validation accuracy at its last epoch): {ran}" if ran else ""


def _choice_line(label: str, c: dict[str, Any]) -> str:
    ru = c.get("runner_up")
    runner = ("no runner-up" if not ru else f"runner-up {ru.get('trial')} at {100 * float(ru['val_acc']):.2f}%"
              + ("" if c.get("margin_images") is None else f", {c['margin_images']:g} validation images behind")
              + (": a tie, broken by the rule in docs/sweeps.md" if c.get("tie") else ""))  # fmt: skip
    return (f"   - {label}: lr {c['lr']:.3g} (validation {100 * c['val_accuracy']:.2f}%, among "
            f"{c['candidates']} trials that trained every epoch; {runner})")  # fmt: skip


def _evidence_lines(ev: dict[str, Any], ans: dict[str, Any]) -> list[str]:
    """What the main seeds' trial records add (pipelines.studies.seed_records): the interval over test images,
    the images' roles, and how each arm started and ended its fine-tuning."""
    parts = []
    for m, name in REPORTED:
        d = ev["images"][m]
        spans = d["low"] <= 0 <= d["high"]
        parts.append(f"{name} {_pp(d['diff'])} [{_pp(d['low'])}, {_pp(d['high'])}] pp "
                     f"({'includes' if spans else 'excludes'} 0)")  # fmt: skip
    rc, n = ev["recovery"], ans["n_seeds"]
    epochs = "/".join(str(e) for e in rc["epochs"])
    tv, cv = rc["tcnn_val"], rc["control_val"]
    out = ["", f"   The interval over seeds holds the test images fixed: it measures how much fine-tuning noise moves "
           f"the answer on these images. Over test images too (the {n} seeds' per-image predictions averaged, "
           f"paired bootstrap over test images as the evaluate stage draws it): {'; '.join(parts)}."]  # fmt: skip
    if ev.get("roles"):
        out += ["", f"   Images, as the fine-tuning recorded them: {ev['roles']}."]
    out += ["", f"   Fine-tuning: {epochs} epochs per arm from the CNN as imported. Right after the conversion at "
            f"alpha = {rc['alpha_init']:g}, lambda = {rc['lambda_init']:g} the T-CNN is at "
            f"{_pp(rc['tcnn_test_at_reparam'], sign=False)}% test accuracy (its CNN: {_pp(rc['cnn_test'], sign=False)}%; "
            f"max |logit diff| {rc['max_logit_diff']:.1f}, {_pp(rc['agreement'], sign=False)}% of probe predictions "
            f"agree). Validation accuracy, mean over seeds, before fine-tuning -> after its last epoch (that epoch's change): T-CNN "
            f"{_pp(tv['start'], sign=False)}% -> {_pp(tv['end'], sign=False)}% ({_pp(tv['last_gain'])} pp), control "
            f"{_pp(cv['start'], sign=False)}% -> {_pp(cv['end'], sign=False)}% ({_pp(cv['last_gain'])} pp)."]  # fmt: skip
    return out


def markdown(rec: dict[str, Any], evidence: dict[str, Any] | None = None) -> str:
    """The study's block: the search's choice per arm, the seeds rule, the answer with its sentences; with
    ``evidence`` (pipelines.studies.seed_records.evidence of the main seeds' records) the interval over test
    images, the images' roles and the fine-tuning's start and end."""
    se, rule, ans = rec["search"], rec["rule"], rec.get("answer")
    kind, (lo, hi) = next(iter(se["space"].items()))
    lines = [f"**{rec['name']}** (`tcnn study run {rec['params']}`" + (", a dry run at smoke size: it checks "
             "the chain and answers nothing)." if rec["dry_run"] else f"; {rec.get('state', '')}).")]  # fmt: skip
    lines += ["", f"1. The lr of each arm: a search on seed {se['seed']} over {KEY} ~ {kind}[{lo:g}, {hi:g}] (at "
              f"batch 1024), {se['points']} points run by both arms, early stopping within each arm, chosen on "
              "validation images only (no test or corrupted image is read):"]  # fmt: skip
    lines += [
        _choice_line(label, se["choice"][arm]) + _edge(se, arm) + _ran(se, arm)
        for arm, label in (("tcnn", "T-CNN"), ("control", "control"))
    ]
    last = rule.get("last", {})
    lines += [f"2. Seeds: fresh seeds after the search's, the first {rule['first']}, then one at a time until "
              f"Student's 95% half-width of T-CNN - control is at most {rule['target_pp']:g} pp on clean accuracy "
              f"and mCA, or {rule['cap']} seeds (the rule's simulated coverage: docs/studies.md). "
              f"Run: {[s['seed'] for s in rec['main']['seeds']]}"
              + (f"; stopped on {last['reason']}." if last.get("run") == 0 else "; going on.")]  # fmt: skip
    comp = se.get("compute") or {}
    seeds_h = sum(s.get("compute_h") or 0.0 for s in rec["main"]["seeds"])
    cpus = sorted(
        {c for part in (comp, *rec["main"]["seeds"]) for c in (part.get("cpus") or "").split("; ") if c}
    )
    lines.append(f"   Compute, as the trials' records say: search {comp.get('compute_h', 0.0):.1f} h, main seeds "
                 f"{seeds_h:.1f} h; CPU: {', '.join(cpus) or 'not recorded'}.")  # fmt: skip
    if not ans:
        return "\n".join([*lines, "", "   No answer yet: fewer than 2 main seeds have finished."]) + "\n"
    lines += ["", f"3. The answer over {ans['unit']} (means over the main seeds, %; the CNN as imported):", "",
              "   | | CNN | control | T-CNN | T-CNN - control (pp) | 95% CI (pp) | half-width (pp) |",
              "   |---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for m, _ in REPORTED:
        r = ans[m]
        models = " | ".join(_pp(r["means"][a], sign=False) for a in MODELS)
        lines.append(f"   | {r['name']} | {models} | {_pp(r['mean'])} | [{_pp(r['low'])}, {_pp(r['high'])}] "
                     f"| {_pp(r['half_width'], sign=False)} |")  # fmt: skip
    sets = rec["answer_sets"]
    lines += ["", f"   mCA is the mean accuracy over {len(sets['corruptions'])} corruptions x "
              f"{len(sets['severities'])} severities ({', '.join(sets['corruptions'])}; severities "
              f"{', '.join(map(str, sets['severities']))}), up to {sets['n_images']} test images per set; "
              "a difference of 1 pp is 1 pp of that mean accuracy.", ""]  # fmt: skip
    lines += [f"   - {sentence(ans[m], ans['unit'])}" for m, _ in REPORTED]
    if evidence is not None:
        lines += _evidence_lines(evidence, ans)
    att = rec.get("attention") or {}
    if att.get("span_end") is not None:
        gate = att.get("gate")
        lines += ["", f"4. Attention: {att['sentence']} The heads' mean span 1/alpha went from "
                  f"{att['span_start']:.3f} (epoch {att['epochs'][0]}) to {att['span_end']:.3f} (epoch "
                  f"{att['epochs'][1]})" + ("" if not gate else f", their mean gate sigma(lambda) (1: positional "
                  f"attention only, 0: content only; T-CNN, d'Ascoli et al. 2021, Eq. 7) from {gate[0]:.3f} to "
                  f"{gate[1]:.3f}, towards {'positional' if gate[1] > gate[0] else 'content'} attention") + " (attention.csv, "
                  "attention.png)."]  # fmt: skip
        if att.get("figure"):
            lines += ["", f"   ![every GPSA head of every seed over fine-tuning]({att['figure']})"]
    return "\n".join(lines) + "\n"


def _search_rows(search_csv: Path) -> list[dict[str, str]]:
    """The committed search.csv's rows (none where it is not there yet)."""
    import csv

    if not search_csv.is_file():
        return []
    with open(search_csv) as fh:
        return list(csv.DictReader(fh))


def edges(search_csv: Path, search: dict[str, Any]) -> dict[str, str]:
    """Per arm, whether its chosen lr is the largest or the smallest the search sampled ("above" / "below":
    where the best may lie beyond what ran), from the committed search.csv; nothing where that is not known."""
    rows = _search_rows(search_csv)
    out = {}
    for arm in ARMS:
        lrs = [float(r[KEY]) for r in rows if r["arm"] == arm]
        lr = search["choice"][arm]["lr"]
        if len(lrs) > 1 and math.isclose(lr, max(lrs), rel_tol=1e-4):
            out[arm] = "above"
        elif len(lrs) > 1 and math.isclose(lr, min(lrs), rel_tol=1e-4):
            out[arm] = "below"
    return out


def candidates(search_csv: Path) -> dict[str, str]:
    """Per arm, every point the search ran, by lr: its validation accuracy at its last epoch, and where early
    stopping ended it (search.csv)."""
    rows = sorted(_search_rows(search_csv), key=lambda r: float(r[KEY]))
    out = {}
    for arm in ARMS:
        out[arm] = ", ".join(
            f"{float(r[KEY]):.3g}: {100 * float(r['val_acc']):.2f}%"
            + ("" if r["status"] == "finished" else f" (stopped after epoch {r['epoch']})")
            for r in rows
            if r["arm"] == arm and r["val_acc"] not in ("", None)
        )
    return out


def gates(attention_csv: Path) -> list[float] | None:
    """The GPSA heads' mean gate sigma(lambda) at the first and the last fine-tuning epoch (attention.csv)."""
    import csv

    if not attention_csv.is_file():
        return None
    with open(attention_csv) as fh:
        rows = [(int(r["epoch"]), float(r["gate"])) for r in csv.DictReader(fh) if r.get("gate")]
    if not rows:
        return None
    first, last = min(e for e, _ in rows), max(e for e, _ in rows)
    return [sum(g for e, g in rows if e == at) / sum(1 for e, _ in rows if e == at) for at in (first, last)]


def block(out: Path, rec: dict[str, Any], fig_dir: str = ".") -> str:
    """The study's block (:func:`markdown`), with what the main seeds' trial records in ``out/trials`` add once
    the answer stands and every main seed's record is there (`tcnn study snapshot` puts them there): then the
    heads' gates and their figure too, linked from ``fig_dir`` (``out`` relative to the page it goes in)."""
    return blocks(out, rec, (fig_dir,))[0]


def blocks(out: Path, rec: dict[str, Any], fig_dirs: tuple[str, ...]) -> list[str]:
    """:func:`block` for each of ``fig_dirs`` (the README's and study.md's), the records read once."""
    from pipelines.studies.seed_records import evidence

    found_search = {"edges": edges(out / "search.csv", rec["search"]), "ran": candidates(out / "search.csv")}
    rec = {**rec, "search": {**rec["search"], **found_search}}
    seeds = [s["seed"] for s in rec["main"]["seeds"]]
    found = evidence(out / RECORDS, rec["name"], seeds) if rec.get("answer") and not rec["dry_run"] else None
    if found is None:
        return [markdown(rec, None) for _ in fig_dirs]
    texts, gate, drawn = [], gates(out / "attention.csv"), (out / "attention.png").is_file()
    for fig_dir in fig_dirs:
        if rec.get("attention"):
            figure = f"{fig_dir}/attention.png" if drawn else None
            rec["attention"] = {**rec["attention"], "gate": gate, "figure": figure}
        texts.append(f"{markdown(rec, found)}\nGenerated by `tcnn study render {out.as_posix()}` from its "
                     f"`study.json`, `search.csv`, `main.csv` and the main seeds' trial records (`{RECORDS}/`).\n")  # fmt: skip
    return texts


def insert_block(readme: Path, name: str, text: str) -> Path:
    """Replace (or append) the block between ``<!-- study:NAME:begin -->`` and its end marker."""
    from pipelines.studies.render import with_block

    old = readme.read_text() if readme.is_file() else ""
    new = with_block(old, name, text)
    if new is None:
        sep = "\n" if old and not old.endswith("\n") else ""
        new = f"{old}{sep}<!-- study:{name}:begin -->\n{text}<!-- study:{name}:end -->\n"
    return atomic_write_text(readme, new)


def render_block(out: Path, readme: Path | None, *, check: bool = False) -> tuple[str, bool]:
    """The block of a study run, again, from its committed ``out/study.json`` (``tcnn study render OUT``):
    returns (block, whether ``readme`` and ``out/study.md`` already held theirs: the same text, the figure
    linked from each); without ``check`` both are rewritten."""
    import os

    from pipelines.studies.render import with_block

    rec = json.loads((out / STATE).read_text())
    if readme is None:
        return block(out, rec), True
    text, own = blocks(out, rec, (Path(os.path.relpath(out, readme.parent)).as_posix(), "."))

    old = readme.read_text()
    new = with_block(old, rec["name"], text)
    if new is None:
        raise StudyRunError(f"{readme}: no <!-- study:{rec['name']}:begin --> ... end --> block")
    md = out / "study.md"
    same = new == old and md.is_file() and md.read_text() == own
    if not check and new != old:
        atomic_write_text(readme, new)
    if not check and not same:
        atomic_write_text(md, own)
    return text, same
