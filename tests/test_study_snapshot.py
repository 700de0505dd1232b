"""`tcnn study snapshot`: a running study's rows, read from its sweeps' Tune and trial files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pipelines.studies.snapshot import COLUMNS, progress_block, snapshot


def _trial(sweep: Path, tid: str, config: dict, vals: list[float], *, done: dict | None = None) -> None:
    tune = sweep / "tune" / tid
    tune.mkdir(parents=True)
    (tune / "params.json").write_text(json.dumps(config))
    reports = [{"epoch": e, "val_acc": v} for e, v in enumerate(vals)] + [{"stage": "done"}]
    (tune / "result.json").write_text("".join(json.dumps(r) + "\n" for r in reports) + '{"epoch": 9, "val')
    (sweep / "trials" / tid).mkdir(parents=True)
    if done is not None:
        (sweep / "trials" / tid / "done.json").write_text(json.dumps(done))


def _study(root: Path) -> Path:
    search = root / "st-search"
    search.mkdir(parents=True)
    (search / "sweep.json").write_text(json.dumps({"name": "st-search", "trials": {}}))
    _trial(search, "p000-tcnn", {"point": 0, "arm": "tcnn", "finetune.lr": 1e-3}, [0.5, 0.6], done={})
    _trial(search, "p001-tcnn", {"point": 1, "arm": "tcnn", "finetune.lr": 1e-4}, [0.4])
    seed = root / "st-seed2"
    seed.mkdir()
    (seed / "sweep.json").write_text(json.dumps({"name": "st-seed2", "trials": {}}))
    _trial(
        seed,
        "p000-control",
        {"point": 0, "arm": "control", "finetune.lr": 2e-3},
        [0.7],
        done={"test_acc": 0.71},
    )
    return root


def test_snapshot_rows_say_each_trials_last_epoch_and_state(tmp_path: Path) -> None:
    # records=False: these sweeps hold Tune's files only, not the plans a record's identity is computed from
    # (tests/test_study_run.py and test_sweep_search.py check the records of real ones)
    summary = snapshot(_study(tmp_path / "sweeps"), "st", tmp_path / "out", records=False)
    lines = (tmp_path / "out" / "progress.csv").read_text().splitlines()
    assert lines[0].split(",") == COLUMNS
    assert lines[1:] == ["search,p000-tcnn,0,tcnn,0.001,1,0.6,finished,",
                         "search,p001-tcnn,1,tcnn,0.0001,0,0.4,stopped or interrupted,",
                         "seed2,p000-control,0,control,0.002,0,0.7,finished,0.71"]  # fmt: skip
    assert {k: (v["trials_reported"], v["trials_finished"]) for k, v in summary["phases"].items()} == {
        "search": (2, 1),
        "seed2": (1, 1),
    }
    assert summary.pop("records_written") == [] and summary["trials_recorded"] == 0
    assert json.loads((tmp_path / "out" / "progress.json").read_text()) == summary
    block = progress_block(tmp_path / "out")  # what the README shows of it
    assert (
        "- search: 1 trial(s) finished of 2 reported" in block
        and "- seed2: 1 trial(s) finished of 1" in block
    )
    assert "| p000-tcnn | tcnn | 0.001 | 1 | 60.00% | finished |" in block
    assert "| p001-tcnn | tcnn | 0.0001 | 0 | 40.00% | stopped or interrupted |" in block
    short = progress_block(tmp_path / "out", table=False)  # the README's: the lines, not the table
    assert short == block.split("\n\n| search trial")[0] + "\n" and "| p000-tcnn" not in short


def test_the_readmes_lines_keep_their_number_as_main_seeds_come(tmp_path: Path) -> None:
    """The README's block (issue 57's README has a line budget): the search's line and one line summing the main
    seeds (trials, hours, CPUs), however many; docs/studies.md's block keeps a line per seed."""
    phases = {"search": {"trials_reported": 12, "trials_finished": 6, "compute_h": 6.71, "cpus": "AMD EPYC"},
              "seed1": {"trials_reported": 1, "trials_finished": 1, "compute_h": 0.63, "cpus": "AMD EPYC"},
              "seed2": {"trials_reported": 1, "trials_finished": 1, "compute_h": 0.5, "cpus": "Intel Xeon"},
              "seed3": {"trials_reported": 1, "trials_finished": 0, "compute_h": 0.1, "cpus": "AMD EPYC"}}  # fmt: skip
    (tmp_path / "progress.json").write_text(json.dumps({"name": "st", "phases": phases, "compute_h": 7.94}))
    (tmp_path / "progress.csv").write_text(",".join(COLUMNS) + "\n")
    lines = progress_block(tmp_path, table=False).splitlines()
    assert lines[1:] == ["- search: 6 trial(s) finished of 12 reported, 6.71 h on AMD EPYC",
                         "- main seeds (seed1-seed3): 2 trial(s) finished of 3 reported, 1.23 h on AMD EPYC, Intel Xeon"]  # fmt: skip
    assert len(progress_block(tmp_path).splitlines()) == 1 + 4


def test_the_docs_show_the_committed_snapshot_of_the_study(monkeypatch) -> None:
    """docs/studies.md's progress block is what `tcnn study snapshot --docs docs/studies.md` makes of the
    committed pipelines/studies/cifar10_resnet20/progress.* (the phases and the search's trials); the study has
    finished, so the README carries its answer (tests/test_study_answer.py) and no progress block."""
    root = Path(__file__).parents[1]
    monkeypatch.chdir(root)
    name = "cifar10-resnet20-progress"
    assert f"<!-- study:{name}:begin -->" not in (root / "README.md").read_text()
    text = (root / "docs/studies.md").read_text()
    table = True
    block = text.split(f"<!-- study:{name}:begin -->\n")[1].split(f"<!-- study:{name}:end -->")[0]
    assert block == progress_block(Path("pipelines/studies/cifar10_resnet20"), table=table)


def test_a_wrong_name_is_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    sweeps = _study(tmp_path / "sweeps")
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "pipelines.cli",
        "study",
        "snapshot",
        "--sweeps",
        str(sweeps),
        "--name",
        "nope",
    ]
    r = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"tcnn study: error: no sweep nope-search under {sweeps}: is the "
                                             "study's name right?"]  # fmt: skip
    assert not out.exists()
