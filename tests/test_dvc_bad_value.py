"""A value the stage refuses does not cost outputs DVC cannot restore. DVC removes a stage's outputs
before it runs the stage's command, so a refusal cannot come before that removal; what makes them restorable is
DVC's run cache, which holds every output of every run, `cache: false` ones (metrics, plot tables) included:
put the value back and `dvc repro` checks them all out again without running the stage. The refusal says so.
A real `dvc repro` in a tiny DVC project, around the real stage harness (stages.harness.runner.stage_main)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import yaml
from _train_helpers import repo_pythonpath, stage_env, tiny_params, write_params

STAGE = textwrap.dedent(
    """
    import json, pathlib, sys
    from stages.harness.runner import stage_main

    def run(params):
        runs = pathlib.Path("runs.log")
        runs.write_text(runs.read_text() + "ran\\n" if runs.exists() else "ran\\n")
        pathlib.Path("out").mkdir(exist_ok=True)
        pathlib.Path("out/model.bin").write_bytes(str(params.finetune.lr).encode() * 1000)
        pathlib.Path("out/metrics.json").write_text(json.dumps({"lr": params.finetune.lr}))

    sys.exit(stage_main("finetune", run, sys.argv[1:]))
    """
)


def _dvc(ws: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = stage_env(TCNN_TRACKING="0", PYTHONPATH=repo_pythonpath())
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=ws, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert not check or proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_a_refused_value_costs_nothing_dvc_repro_cannot_bring_back(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    write_params(ws / "params.yaml", tiny_params(ws / "data"))
    (ws / "stage.py").write_text(STAGE)
    stage = {"cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["finetune.lr"],
             "outs": ["out/model.bin"], "metrics": [{"out/metrics.json": {"cache": False}}]}  # fmt: skip
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"finetune": stage}}))
    _dvc(ws, "init", "--no-scm", "-q")
    _dvc(ws, "repro")
    good = {p: (ws / p).read_bytes() for p in ("out/model.bin", "out/metrics.json", "params.yaml")}

    raw = yaml.safe_load(good["params.yaml"])
    raw_lr = raw["finetune"]["lr"]
    raw["finetune"]["lr"] = -1
    write_params(ws / "params.yaml", raw)
    bad = _dvc(ws, "repro", check=False)
    said = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert "finetune: error: params.yaml: finetune.lr: Input should be greater than 0" in said
    assert "put the value back and run dvc repro: DVC's run cache restores this stage's outputs" in said
    assert f"its last run had finetune.lr: {raw_lr!r})" in said  # the value to put back (issue 59, 10)
    assert (
        not (ws / "out" / "model.bin").exists() and not (ws / "out" / "metrics.json").exists()
    )  # DVC's doing

    (ws / "params.yaml").write_bytes(good["params.yaml"])
    again = _dvc(ws, "repro")
    assert "Stage 'finetune' is cached - skipping run, checking out outputs" in again.stdout
    assert {p: (ws / p).read_bytes() for p in good} == good  # every output back, the uncached metrics too
    assert (ws / "runs.log").read_text() == "ran\n"  # restored, not run again


def test_a_refusal_with_no_earlier_value_does_not_say_put_it_back(tmp_path: Path) -> None:
    """Issue 59 (10): a value refused at the stage's first run (dvc.lock records no earlier one) gets no advice to
    put a value back: there is none."""
    ws = tmp_path / "ws"
    ws.mkdir()
    raw = tiny_params(ws / "data")
    raw["finetune"]["lr"] = -1
    write_params(ws / "params.yaml", raw)
    (ws / "stage.py").write_text(STAGE)
    stage = {"cmd": f"{sys.executable} stage.py", "deps": ["stage.py"], "params": ["finetune.lr"],
             "outs": ["out/model.bin"], "metrics": [{"out/metrics.json": {"cache": False}}]}  # fmt: skip
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"finetune": stage}}))
    _dvc(ws, "init", "--no-scm", "-q")
    bad = _dvc(ws, "repro", check=False)
    said = bad.stdout + bad.stderr
    assert (
        bad.returncode != 0
        and "finetune: error: params.yaml: finetune.lr: Input should be greater than 0" in said
    )
    assert "put the value back" not in said and "run cache" not in said, said
