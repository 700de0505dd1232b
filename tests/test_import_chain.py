"""`dvc repro` from a user's own architecture and checkpoint: the builder module and its
``{"state_dict": ...}`` checkpoint with DataParallel prefixes are written by the test into a tiny project; every
stage runs on the imported CNN, MLflow and the report name the source, the weights file is a DVC dependency
(a changed file reruns the chain, nothing changed is a no-op)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from _pipeline_repo import STAGES, client, dvc, make_repo, runs
from test_import import save_user_checkpoint, write_builder

pytestmark = pytest.mark.slow


def _set_sha(repo: Path, sha: str) -> None:
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["pretrain"]["source"]["sha256"] = sha
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def test_a_users_checkpoint_runs_the_whole_chain(tmp_path: Path) -> None:
    made = tmp_path / "made"
    made.mkdir()
    write_builder(made)
    path, sha = save_user_checkpoint(made, seed=0)
    source = {"weights": "data/pretrained/mine.pth", "sha256": sha, "mean": [0.3], "std": [0.35]}
    repo = make_repo(tmp_path / "imp", {"model": {"kind": "tcnn", "arch": "mynets:small", "code": "mynets.py"},
                                        "pretrain": {"source": source}, "reparam": {"stages": [-1]}})  # fmt: skip
    write_builder(repo)
    (repo / "data" / "pretrained").mkdir(parents=True, exist_ok=True)
    shutil.copy(path, repo / "data" / "pretrained" / "mine.pth")

    out = dvc(repo, "repro")
    for stage in STAGES:
        assert f"Running stage '{stage}'" in out.stdout, out.stdout[-3000:]
    pre = json.loads((repo / "runs/pretrain/metrics.json").read_text())
    assert pre["imported"] and pre["source"]["sha256"] == sha and pre["epochs"] == 0
    eq = json.loads((repo / "runs/reparam/equivalence.json").read_text())
    assert eq["imported"] and eq["reparam_epoch"] == 0 and eq["compared"] == "logits"
    assert eq["gpsa_layers"] == ["layer2.0.conv1", "layer2.0.conv2"]
    large = next(r for r in eq["inits"] if r["init"] == "large")
    assert large["max_abs_logit_diff"] < 1e-4
    # evaluate scores the imported CNN as the CNN: its clean test accuracy is pretrain's
    results = json.loads((repo / "results/metrics.json").read_text())
    assert results["cnn"]["clean_accuracy"] == pytest.approx(pre["test_acc"], abs=1e-9)
    control = json.loads((repo / "runs/control/metrics.json").read_text())
    assert control["epochs_run"] == 1 and results["control"]["clean_accuracy"] == pytest.approx(
        control["test_acc"], abs=1e-9
    )
    html = (repo / "results/report.html").read_text()
    assert (
        "data/pretrained/mine.pth" in html
        and sha in html
        and "mean [0.3], std [0.35] (pretrain.source)" in html
    )

    parent = next(r for r in runs(repo) if "mlflow.parentRunId" not in r.data.tags)
    assert parent.data.tags["tcnn.cnn_source_sha256"] == sha
    assert parent.data.tags["tcnn.cnn_source"] == "data/pretrained/mine.pth"
    assert parent.data.tags["tcnn.classifier_replaced"] == "no"
    assert parent.data.params["pretrain.source.sha256"] == sha
    assert client(repo).get_run(parent.info.run_id).info.status == "FINISHED"

    # nothing changed: a no-op
    again = dvc(repo, "repro")
    assert "Running stage" not in again.stdout, again.stdout[-2000:]
    # the builder is network code (model.code: mynets.py): an edit of it is a change of every stage that builds
    # the network, and the checkpoint records its digest for a run outside DVC
    builder = repo / "mynets.py"
    assert torch.load(repo / "runs/pretrain/ckpt/ckpt-epoch-000.pt", weights_only=False)["network_code"] == {
        "mynets.py": hashlib.sha256(builder.read_bytes()).hexdigest()
    }
    original = builder.read_bytes()
    builder.write_bytes(original + b"\n# edited\n")
    edited = json.loads(dvc(repo, "status", "--json").stdout or "{}")
    builder.write_bytes(original)
    assert set(edited) == {"pretrain", "reparam", "finetune", "control", "evaluate", "report"}, edited

    # the weights file changed (params not yet): DVC reruns pretrain, which refuses it with one line
    path2, sha2 = save_user_checkpoint(made, seed=1)
    shutil.copy(path2, repo / "data" / "pretrained" / "mine.pth")
    status = dvc(repo, "status")
    assert "pretrain" in status.stdout and "data/pretrained" in status.stdout, status.stdout
    refused = dvc(repo, "repro", check=False)
    assert refused.returncode != 0
    assert f"sha256 {sha2} does not match pretrain.source.sha256 {sha}" in refused.stdout + refused.stderr
    # with its new sha256 pretrain reruns on the new weights, and DVC has everything downstream to rerun
    # (the stages after pretrain were run once above; running them again would only repeat that)
    _set_sha(repo, sha2)
    rerun = dvc(repo, "repro", "pretrain")
    assert "Running stage 'pretrain'" in rerun.stdout
    downstream = dvc(repo, "status").stdout  # the stages that read the new CNN checkpoint
    assert all(f"{stage}:" in downstream for stage in ("reparam", "control", "evaluate", "report")), (
        downstream
    )
    new = json.loads((repo / "runs/pretrain/metrics.json").read_text())
    assert new["source"]["sha256"] == sha2
    saved = torch.load(path2, weights_only=True)["state_dict"]
    final = torch.load(repo / "runs/pretrain/cnn-final.pt", weights_only=True)["model"]
    assert all(torch.equal(final[k.removeprefix("module.")], v) for k, v in saved.items())
