"""Deliberate bugs in the headline paths, and which tests catch them: the evidence that a faster suite checks
as much as the slower one did (issue 45).

    .venv/bin/python scripts/mutations.py [--repo PATH] [--only M01,M07] [--out FILE.json]

For every mutation below (one exact edit of one file: a bug a careless change could make), the script applies
it to the checkout at ``--repo`` (default: this one), runs the named tests with that checkout's own
interpreter (``.venv/bin/python -m pytest``, no xdist, no `-x`: every named test runs), records which of them
failed, and puts the file back. First it runs every named test once unmutated: a mutation counts as caught only
by tests that pass without it. Run it on two checkouts (before and after a change to the suite) and compare the
"caught by" sets (``--compare before.json after.json``).

The mutations apply unchanged to the suite before issue 45 (f0df390) and after it: each ``old`` text is in
both versions of the code.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    area: str  # conversion | control | intervals | selection | refusal | resume | dvc
    what: str  # the bug, in words
    file: str
    old: str
    new: str
    tests: tuple[str, ...]  # pytest node ids (files or single tests)


MUTATIONS: tuple[Mutation, ...] = (
    # ---- conversion exactness ([TCNN21] Sec. 2: the GPSA at large alpha computes the conv)
    Mutation("M01", "conversion", "GPSA heads attend to the transposed conv taps (row/col swapped)",
             "core/nn/positional.py",
             "torch.stack([(idx // k - c) * d, (idx % k - c) * d], dim=1)",
             "torch.stack([(idx % k - c) * d, (idx // k - c) * d], dim=1)",
             ("tests/test_gpsa.py", "tests/test_import_chain.py")),
    Mutation("M02", "conversion", "the conv's filter is copied mirrored into the GPSA",
             "core/nn/positional.py", "m.weight.copy_(conv.weight)", "m.weight.copy_(conv.weight.flip(-1))",
             ("tests/test_reparam.py",
              "tests/test_stages_train.py::test_chain_writes_its_outputs_and_reparam_preserves_the_function")),
    Mutation("M03", "conversion", "the conversion uses a tenth of the alpha asked for (large init no longer exact)",
             "core/models/conversion.py", "conv, alpha_init=alpha_init, stride_mode=stride_mode",
             "conv, alpha_init=alpha_init / 10, stride_mode=stride_mode",
             ("tests/test_reparam.py", "tests/test_import_chain.py")),
    # ---- the matched control: the same checkpoint, the same recipe, the same seed stream
    Mutation("M04", "control", "the control trains at twice the T-CNN's lr",
             "stages/control.py", "metrics = train(params.for_control(), root,",
             "metrics = train(params.with_overrides({'finetune.lr': 2 * params.finetune.lr}), root,",
             ("tests/test_control.py",)),
    Mutation("M05", "control", "the control draws its data order and noise from its own seed stream",
             "stages/harness/fine_tuning.py", "seed = derive_seed(params.seed, NAME)",
             "seed = derive_seed(params.seed, variant.name)", ("tests/test_control.py",)),
    # ---- interval ends: what is computed, logged and said
    Mutation("M06", "intervals", "the bootstrap interval takes the 1.25 / 98.75 percentiles",
             "core/robustness/intervals.py", "tail = 100 * (1 - confidence) / 2",
             "tail = 100 * (1 - confidence) / 4", ("tests/test_intervals.py", "tests/test_headline.py")),
    Mutation("M07", "intervals", "a difference's interval ends are swapped",
             "core/robustness/intervals.py", 'return {"diff": diff, "low": lo, "high": hi,',
             'return {"diff": diff, "low": hi, "high": lo,',
             ("tests/test_intervals.py", "tests/test_evaluate_stage.py")),
    Mutation("M08", "intervals", "an interval 'excludes zero' only when both ends are on both sides",
             "core/robustness/intervals.py", '"excludes_zero": bool(lo > 0 or hi < 0)',
             '"excludes_zero": bool(lo > 0 and hi < 0)', ("tests/test_intervals.py", "tests/test_headline.py")),
    Mutation("M09", "intervals", "the t-interval over seeds uses the population SD",
             "core/robustness/intervals.py", "sd = float(v.std(ddof=1))", "sd = float(v.std(ddof=0))",
             ("tests/test_intervals.py", "tests/test_sweep.py")),
    Mutation("M10", "intervals", "the parent run logs the interval's low end as its high end and back",
             "stages/harness/catalogue.py",
             'for end, field in (("", "diff"), ("_ci_low", "low"), ("_ci_high", "high"))\n    },\n    # The same',
             'for end, field in (("", "diff"), ("_ci_low", "high"), ("_ci_high", "low"))\n    },\n    # The same',
             ("tests/test_pipeline_e2e.py::test_final_metrics_on_the_parent", "tests/test_headline.py")),
    Mutation("M11", "intervals", "the report calls a higher mCE 'better' (the sentence ignores the direction)",
             "core/viz/report_html.py", 'better = (d["diff"] > 0) == higher_is_better', 'better = d["diff"] > 0',
             ("tests/test_headline.py", "tests/test_report.py")),
    # ---- hyperparameters chosen on validation data, each arm on its own
    Mutation("M12", "selection", "the selection keeps the worst validation score",
             "pipelines/sweep/selection.py", "                if v > value:", "                if v < value:",
             ("tests/test_sweep.py", "tests/test_sweep_bracket.py")),
    Mutation("M13", "selection", "the selection reads the test split's accuracy",
             "pipelines/sweep/selection.py", 'scored = [(m, m.get(f"{arm}_{by}")) for m in members]',
             'scored = [(m, m.get(f"{arm}_clean_accuracy")) for m in members]',
             ("tests/test_sweep.py", "tests/test_sweep_bracket.py")),
    Mutation("M14", "selection", "both arms take the T-CNN's choice (the control is not chosen on its own curve)",
             "pipelines/sweep/selection.py", 'scored = [(m, m.get(f"{arm}_{by}")) for m in members]',
             'scored = [(m, m.get(f"tcnn_{by}")) for m in members]',
             ("tests/test_sweep.py", "tests/test_sweep_bracket.py")),
    # ---- refusals before any run opens
    Mutation("M15", "refusal", "a stage's check no longer runs before its MLflow runs open",
             "stages/harness/runner.py", "            if check is not None:\n                check(params)",
             "            if False:\n                check(params)",
             ("tests/test_stops.py", "tests/test_bad_inputs.py")),
    Mutation("M16", "refusal", "evaluate no longer refuses missing model checkpoints up front",
             "stages/evaluate.py", "    if missing:\n        raise StageError(",
             "    if False:\n        raise StageError(", ("tests/test_stops.py", "tests/test_bad_inputs.py")),
    # ---- resume: a resumed run matches an unbroken one
    Mutation("M17", "resume", "a resumed run restarts the lr schedule",
             "core/training/loop.py", '    job.scheduler.load_state_dict(state["scheduler"])\n', "",
             ("tests/test_train_checkpoint.py", "tests/test_resume_kill.py")),
    Mutation("M18", "resume", "a resumed run replays its epoch from the first batch",
             "core/training/loop.py", "job.train_loader.batches(run.epoch, run.step)",
             "job.train_loader.batches(run.epoch, 0)",
             ("tests/test_train_checkpoint.py", "tests/test_resume_kill.py")),
    Mutation("M19", "resume", "a partial run of other params is resumed instead of started fresh",
             "core/training/resume_file.py", 'if state.get("format") != STATE_FORMAT or state.get("run_hash") != run_hash:',
             'if state.get("format") != STATE_FORMAT:',
             ("tests/test_train_checkpoint.py", "tests/test_resume_kill.py")),
    # ---- DVC: a change reruns what it must
    Mutation("M20", "dvc", "the GPSA layer's code is no DVC dependency of the reparam stage",
             "dvc.yaml", "      - core/nn/gpsa.py\n", "",
             ("tests/test_dvc_deps.py",)),
)  # fmt: skip


def _pytest(repo: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, list[str], float]:
    """(exit status, failed node ids, seconds) of pytest on ``tests`` in ``repo``."""
    t0 = time.monotonic()
    report = repo / ".mutation-report.xml"
    cmd = [str(repo / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-p", "no:randomly", f"--junitxml={report}", *tests]  # fmt: skip
    try:
        out = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout)
        code = out.returncode
    except subprocess.TimeoutExpired:
        code = -1
    failed = _failed(report)
    report.unlink(missing_ok=True)
    return code, failed, time.monotonic() - t0


def _failed(report: Path) -> list[str]:
    import xml.etree.ElementTree as ET

    if not report.is_file():
        return []
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            failed.append(f"{module}.py::{case.get('name')}")
    return sorted(failed)


def run(repo: Path, only: set[str] | None, timeout: float) -> dict:
    chosen = [m for m in MUTATIONS if only is None or m.id in only]
    for m in chosen:  # every edit applies, once, before anything runs
        text = (repo / m.file).read_text()
        if text.count(m.old) < 1:
            raise SystemExit(f"{m.id}: {m.file} does not contain the text to mutate")
    tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
    code, broken, secs = _pytest(repo, tests, timeout)
    print(f"unmutated: exit {code}, {len(broken)} failing, {secs:.0f} s", flush=True)
    if code != 0:
        raise SystemExit(f"the tests fail without any mutation: {broken}")
    rows = []
    for m in chosen:
        path = repo / m.file
        original = path.read_text()
        path.write_text(original.replace(m.old, m.new, 1))
        try:
            code, failed, secs = _pytest(repo, m.tests, timeout)
        finally:
            path.write_text(original)
        caught = code != 0 and bool(failed)
        rows.append(
            {**asdict(m), "exit": code, "caught": caught, "caught_by": failed, "seconds": round(secs, 1)}
        )
        print(f"{m.id} {m.area:10s} {'caught' if caught else 'MISSED'} ({secs:.0f} s) by {len(failed)} test(s): "
              f"{m.what}", flush=True)  # fmt: skip
    return {"repo": str(repo), "commit": _commit(repo), "mutations": rows}


def _commit(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def compare(before: dict, after: dict) -> str:
    """A Markdown table: each mutation, caught before / after, and the tests that caught it in each."""
    b = {r["id"]: r for r in before["mutations"]}
    lines = [f"| id | area | bug | before ({before['commit']}) | after ({after['commit']}) | caught by (after) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in after["mutations"]:
        old = b.get(r["id"])
        was = (
            "—"
            if old is None
            else f"{'caught' if old['caught'] else 'MISSED'}, {len(old['caught_by'])} tests"
        )
        now = f"{'caught' if r['caught'] else 'MISSED'}, {len(r['caught_by'])} tests"
        names = ", ".join(sorted({t.split("::")[0].removeprefix("tests/") for t in r["caught_by"]}))
        lines.append(f"| {r['id']} | {r['area']} | {r['what']} | {was} | {now} | {names} |")
    lost = [(r["id"], t) for r in after["mutations"] if r["id"] in b
            for t in b[r["id"]]["caught_by"] if t not in r["caught_by"]]  # fmt: skip
    lines.append("")
    lines.append("Tests that caught a mutation before and not after: " + (
        ", ".join(f"{i} {t}" for i, t in lost) if lost else "none."))  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--only", help="comma-separated mutation ids")
    ap.add_argument("--out", type=Path, help="write the results as JSON")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                    help="print the Markdown table of two results files")  # fmt: skip
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after))
        return 0
    result = run(args.repo.resolve(), set(args.only.split(",")) if args.only else None, args.timeout)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    missed = [r["id"] for r in result["mutations"] if not r["caught"]]
    print(f"{len(result['mutations']) - len(missed)} of {len(result['mutations'])} caught" +
          (f"; missed: {', '.join(missed)}" if missed else ""))  # fmt: skip
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
