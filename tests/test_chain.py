"""dvc.yaml is the one graph: the stage order, each stage's outputs and folders, how a sweep runs each stage, and
what MLflow logs are read from it (stages/harness/chain.py, stages/harness/catalogue.py). These tests hold the reading against
the file itself and against small dvc.yaml files written here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipelines.sweep.shared import ENSURE
from stages.harness import catalogue, chain

REPO = Path(__file__).resolve().parents[1]


def _raw() -> dict:
    return yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def test_every_stage_says_how_a_sweep_runs_it_and_trial_stages_keep_the_chain_order() -> None:
    stages = _raw()
    roles = {s: chain.sweep_role(s) for s in stages}
    assert set(roles.values()) <= set(chain.SWEEP_ROLES)
    # A trial's stages: the chain's order restricted to group and trial stages; each one's stage-output deps
    # come from stages before it or from stages the driver built first (input, sweep).
    trial = chain.trial_stages()
    assert list(trial) == [s for s in stages if roles[s] in ("group", "trial")]
    producer = {out: s for s in stages for out in chain.outputs(s)}
    for i, s in enumerate(trial):
        for dep in stages[s]["deps"]:
            up = producer.get(dep)
            if up is not None and up != s:
                assert up in trial[:i] or roles[up] in ("input", "sweep"), (s, dep, up)
    # The shared stages are the ones the sweep knows how to share, and they train.
    assert {s for s, r in roles.items() if r == "group"} == set(ENSURE)
    assert {s for s in stages if chain.trains(s)} == {"pretrain", "finetune", "control"}


def test_folders_and_files_come_from_a_stage_outputs(tmp_path: Path) -> None:
    dvc = {"stages": {
        "a": {"cmd": "x", "meta": {"metrics_file": "out/a/metrics.json"},
              "outs": ["out/a/ckpt", "out/a/m-final.pt", "out/a/h.csv", "out/a/metrics.json"]},
        "b": {"cmd": "x", "meta": {"metrics_file": "res/m.json"},
              "outs": ["${data.dir}", "res/t.parquet", "res/plots/p.png", "res/m.json", "res/cached.json"],
              "metrics": [{"res/headline": {"cache": False}}]},
        "c": {"cmd": "x", "meta": {"metrics_file": "res/elsewhere.json"}, "outs": ["res/c.json"]},
    }}  # fmt: skip
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    assert chain.outputs("a", tmp_path) == (
        "out/a/ckpt",
        "out/a/m-final.pt",
        "out/a/h.csv",
        "out/a/metrics.json",
    )
    assert chain.run_dir("a", tmp_path) == "out/a" and chain.run_dir("b", tmp_path) == "res"
    assert chain.metrics_file("a", tmp_path) == "out/a/metrics.json"
    assert chain.metrics_file("b", tmp_path) == "res/m.json"  # the out meta.metrics_file names
    with pytest.raises(KeyError, match="names no metrics_file"):  # a name that is no out of the stage
        chain.metrics_file("c", tmp_path)
    assert chain.headline_dir(tmp_path) == "res/headline"  # DVC's one `metrics:` entry
    assert chain.outputs("b", tmp_path)[-1] == "res/headline"
    assert chain.output("a", "h.csv", tmp_path) == "out/a/h.csv"
    assert chain.resolve("${data.dir}/x", {"data": {"dir": "d/f"}}) == "d/f/x"
    assert chain.partial_dir("a") == f"{chain.PARTIAL}/a"


def test_artifacts_are_the_stage_outputs_with_data_left_to_dvc(tmp_path: Path) -> None:
    """pretrain logs its checkpoints under checkpoints/, its tables at the top; prepare logs its manifest, not
    its shards; a stage logs nothing it did not write."""
    params = {"data": {"dir": "data/x"}, "robustness": {"dir": "data/x-c"}}
    root = tmp_path
    for rel in ("runs/pretrain/ckpt/ckpt-epoch-001.pt", "runs/pretrain/cnn-final.pt", "runs/pretrain/metrics.json",
                "data/x/manifest.json", "data/x/train/part-0.parquet"):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    got = {
        str(p.relative_to(root)): folder for p, folder in catalogue.stage_artifacts("pretrain", params, root)
    }
    assert got == {
        "runs/pretrain/ckpt/ckpt-epoch-001.pt": "checkpoints/ckpt",
        "runs/pretrain/cnn-final.pt": "checkpoints",
        "runs/pretrain/metrics.json": None,
    }
    prepared = catalogue.stage_artifacts("prepare", params, root)
    assert [(str(p.relative_to(root)), f) for p, f in prepared] == [("data/x/manifest.json", None)]
    assert catalogue.final_model("pretrain", params, root) == root / "runs/pretrain/cnn-final.pt"
    assert catalogue.final_model("finetune", params, root) is None


def test_summary_metrics_read_each_stage_metrics_file(tmp_path: Path) -> None:
    (tmp_path / "runs/pretrain").mkdir(parents=True)
    (tmp_path / "runs/pretrain/metrics.json").write_text('{"test_acc": 0.75, "val_acc": 0.5}')
    got = catalogue.summary_metrics(tmp_path)
    assert got == {"cnn_test_acc": 0.75, "cnn_val_accuracy": 0.5}
    assert all(chain.metrics_file(stage) for stage, _ in catalogue.SUMMARY_METRICS.values())
