"""`dvc repro` of a tiny configuration end to end in a copy of the repository, then the MLflow store.

Truths the checks compare against: the files the chain wrote (history, metrics, equivalence report,
manifest, checkpoints), git and DVC themselves (HEAD, dvc.lock, `dvc status`, which stages DVC ran).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from _pipeline_repo import FMNIST_DIR, REPO, STAGES, built_repo, children, client, dvc, runs

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (FMNIST_DIR / "train-images-idx3-ubyte.gz").exists(),
        reason=f"Fashion-MNIST not installed at {FMNIST_DIR} (Debian package dataset-fashion-mnist)",
    ),
]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_repo(tmp_path_factory)


@pytest.fixture()
def own_repo(repo: Path, tmp_path: Path) -> Path:
    """A private copy of the built repository, for tests that change params or run experiments (the shared one
    stays as `dvc repro` left it for every other test)."""
    dst = tmp_path / "repo"
    shutil.copytree(repo, dst, symlinks=True)
    return dst


def _parents(all_runs):
    return [r for r in all_runs if r.data.tags.get("tcnn.kind") == "parent"]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download(repo: Path, run_id: str, artifact: str, dst: Path) -> Path:
    return Path(client(repo).download_artifacts(run_id, artifact, str(dst)))


def _artifact_paths(repo: Path, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for info in client(repo).list_artifacts(run_id, path):
        out |= _artifact_paths(repo, run_id, info.path) if info.is_dir else {info.path}
    return out


def test_one_parent_with_one_finished_child_per_stage(repo: Path) -> None:
    all_runs = runs(repo)
    parents = _parents(all_runs)
    assert len(parents) == 1
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    kids = children(all_runs, parent.info.run_id)
    assert sorted(r.data.tags["tcnn.stage"] for r in kids) == sorted(STAGES)
    assert {r.info.status for r in kids} == {"FINISHED"}
    assert {r.info.run_name for r in kids} == set(STAGES)
    assert len(all_runs) == 1 + len(STAGES)  # nothing else: no duplicate, no leftover
    # stages ran in the chain's order
    starts = {r.data.tags["tcnn.stage"]: r.info.start_time for r in kids}
    assert [s for s in sorted(starts, key=starts.get)] == list(STAGES)


def test_parent_tags_git_commit_and_dvc_lock(repo: Path, tmp_path: Path) -> None:
    parent = _parents(runs(repo))[0]
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert parent.data.tags["mlflow.source.git.commit"] == head.stdout.strip()
    # the first run of a fresh repository: clean (what `dvc repro` rewrote is its own), named by its command
    assert parent.data.tags["tcnn.git_dirty"] == "False"
    assert parent.data.tags["mlflow.source.name"] == "dvc repro"
    lock_tag = parent.data.tags["tcnn.dvc_lock_sha256"]
    logged = _download(repo, parent.info.run_id, "dvc.lock", tmp_path)
    assert _sha256(logged) == lock_tag
    # The logged lock is the one of the finished chain, except for the last stage (DVC records it after
    # the report's process exits): every other stage's entry equals the final dvc.lock's.
    final = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    seen = yaml.safe_load(logged.read_text())["stages"]
    for stage in STAGES[:-1]:
        assert seen[stage] == final[stage], stage
    assert (
        _download(repo, parent.info.run_id, "params.yaml", tmp_path).read_text()
        == (repo / "params.yaml").read_text()
    )
    env = _download(repo, parent.info.run_id, "environment/requirements.txt", tmp_path).read_text()
    from importlib.metadata import version

    for dist in ("mlflow", "torch", "dvc"):  # as `pip freeze` names them
        assert f"{dist}=={version(dist)}" in env.splitlines()
    # the locked environment: the repository's uv.lock itself, and its hash as a tag
    lock = _download(repo, parent.info.run_id, "environment/uv.lock", tmp_path)
    assert lock.read_bytes() == (repo / "uv.lock").read_bytes()
    assert parent.data.tags["tcnn.uv_lock_sha256"] == _sha256(repo / "uv.lock")


def test_params_have_stable_names(repo: Path) -> None:
    all_runs = runs(repo)
    params = yaml.safe_load((repo / "params.yaml").read_text())
    expected = {
        "alpha_init": str(params["reparam"]["alpha_init"]),
        "lambda_init": str(params["reparam"]["lambda_init"]),
        "reparam_epoch": str(params["reparam"]["epoch"]),
        "sample_fraction": str(params["data"]["sample_fraction"]),
        "pretrain.epochs": str(params["pretrain"]["epochs"]),
        "robustness.corruptions": json.dumps(params["robustness"]["corruptions"], separators=(",", ":")),
    }
    for run in all_runs:  # parent and every stage carry the same names
        for key, value in expected.items():
            assert run.data.params.get(key) == value, (run.info.run_name, key)
        assert "reparam.alpha_init" not in run.data.params


def test_final_metrics_on_the_parent(repo: Path) -> None:
    parent = _parents(runs(repo))[0]
    m = parent.data.metrics
    res = json.loads((repo / "results" / "metrics.json").read_text())
    eq = json.loads((repo / "runs" / "reparam" / "equivalence.json").read_text())
    expected = {
        "equivalence_error": eq["max_abs_logit_diff"],
        "cnn_test_acc": json.loads((repo / "runs/pretrain/metrics.json").read_text())["test_acc"],
        "tcnn_test_acc": json.loads((repo / "runs/finetune/metrics.json").read_text())["test_acc"],
    }
    for model in ("cnn", "tcnn"):
        for key in ("clean_accuracy", "mca", "mce", "relative_mce"):
            expected[f"{model}_{key}"] = res[model].get(key)  # absent or None when undefined
    for name, value in expected.items():
        if value is None or not math.isfinite(value):  # e.g. relative mCE undefined on a tiny test set
            assert name not in m
        else:
            assert m[name] == pytest.approx(value, rel=1e-12), name
    assert {"equivalence_error", "cnn_clean_accuracy", "tcnn_clean_accuracy", "tcnn_mce"} <= set(m)


def test_per_epoch_metrics_with_step(repo: Path) -> None:
    all_runs = runs(repo)
    parent = _parents(all_runs)[0]
    by_stage = {r.data.tags["tcnn.stage"]: r for r in children(all_runs, parent.info.run_id)}
    c = client(repo)
    history = json.loads((repo / "runs/pretrain/history.json").read_text())
    got = c.get_metric_history(by_stage["pretrain"].info.run_id, "epoch/val_acc")
    assert [(p.step, p.value) for p in got] == [(row["epoch"], row["val_acc"]) for row in history]
    ft = json.loads((repo / "runs/finetune/history.json").read_text())
    layer = next(iter(ft[-1]["gpsa"]))
    for key in ("inv_alpha", "gate"):
        got = c.get_metric_history(by_stage["finetune"].info.run_id, f"epoch/gpsa/{layer}/{key}")
        want = [
            (row["finetune_epoch"], sum(row["gpsa"][layer][key]) / len(row["gpsa"][layer][key])) for row in ft
        ]
        assert [p.step for p in got] == [s for s, _ in want]
        assert [p.value for p in got] == pytest.approx([v for _, v in want], rel=1e-6)
    # system metrics (psutil) sampled during the stage
    assert any(k.startswith("system/cpu_utilization") for k in by_stage["pretrain"].data.metrics)


def test_artifacts_checkpoints_tables_plots(repo: Path, tmp_path: Path) -> None:
    all_runs = runs(repo)
    parent = _parents(all_runs)[0]
    by_stage = {r.data.tags["tcnn.stage"]: r.info.run_id for r in children(all_runs, parent.info.run_id)}
    want = {
        "pretrain": {"checkpoints/cnn-final.pt", "checkpoints/ckpt/ckpt-epoch-001.pt", "history.csv", "metrics.json"},
        "reparam": {"equivalence.json", "checkpoints/tcnn.pt"},
        "finetune": {"checkpoints/tcnn-final.pt", "gpsa.csv", "history.csv"},
        "evaluate": {"robustness.parquet", "metrics.json", "plots/robustness_gain.png", "headline/tcnn-control.json"},
        "report": {"report.html", "plots/fig4_dynamics.png", "plots/fig5_attention.png", "plots/training_curves.png"},
    }  # fmt: skip
    for stage, names in want.items():
        assert names <= _artifact_paths(repo, by_stage[stage]), stage
    assert {"dvc.lock", "params.yaml", "report.html", "environment/requirements.txt"} <= _artifact_paths(
        repo, parent.info.run_id
    )
    # byte-identical to what the chain wrote
    for run_id, artifact, local in (
        (by_stage["reparam"], "equivalence.json", "runs/reparam/equivalence.json"),
        (by_stage["evaluate"], "robustness.parquet", "results/robustness.parquet"),
        (by_stage["finetune"], "checkpoints/tcnn-final.pt", "runs/finetune/tcnn-final.pt"),
    ):
        assert _sha256(_download(repo, run_id, artifact, tmp_path / run_id)) == _sha256(repo / local)


def test_datasets_logged_with_manifest_digest(repo: Path) -> None:
    all_runs = runs(repo)
    parent = _parents(all_runs)[0]
    by_stage = {r.data.tags["tcnn.stage"]: r for r in children(all_runs, parent.info.run_id)}
    digest = _sha256(repo / "data/fashion_mnist/manifest.json")[:36]
    index = _sha256(repo / "data/fashion_mnist-c/index.json")[:36]

    def inputs(stage: str) -> set[tuple[str, str, str]]:
        run = client(repo).get_run(by_stage[stage].info.run_id)
        return {
            (
                d.dataset.name,
                d.dataset.digest,
                next(t.value for t in d.tags if t.key == "mlflow.data.context"),
            )
            for d in run.inputs.dataset_inputs
        }

    assert ("fashion_mnist", digest, "prepared") in inputs("prepare")
    assert ("fashion_mnist", digest, "train") in inputs("pretrain")
    assert {("fashion_mnist", digest, "test"), ("fashion_mnist-c", index, "test-corrupted")} <= inputs(
        "evaluate"
    )


def test_logged_models_give_the_checkpoints_logits(repo: Path) -> None:
    import mlflow
    import mlflow.pytorch
    import torch

    from core.training.checkpoint import load_model

    all_runs = runs(repo)
    parent = _parents(all_runs)[0]
    by_stage = {r.data.tags["tcnn.stage"]: r.info.run_id for r in children(all_runs, parent.info.run_id)}
    c = client(repo)
    models = c.search_logged_models(experiment_ids=[parent.info.experiment_id])
    found = {(m.name, m.source_run_id): m.model_id for m in models}
    x = torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(f"sqlite:///{repo / 'mlruns.db'}")
    try:
        for name, stage, ckpt in (("tcnn", "finetune", "runs/finetune/tcnn-final.pt"),
                                  ("cnn", "pretrain", "runs/pretrain/cnn-final.pt")):  # fmt: skip
            model_id = found[(name, by_stage[stage])]
            logged = mlflow.pytorch.load_model(f"models:/{model_id}").eval()
            reference = load_model(repo / ckpt)
            with torch.no_grad():
                ref = reference(x)
                assert torch.equal(logged(x), ref), name
            assert ref.abs().max() > 0
    finally:
        mlflow.set_tracking_uri(previous)


def test_report_lists_the_run_ids(repo: Path) -> None:
    all_runs = runs(repo)
    parent = _parents(all_runs)[0]
    html = (repo / "results" / "report.html").read_text()
    ids = json.loads((repo / "runs" / "mlflow_runs.json").read_text())
    assert ids["parent"] == parent.info.run_id
    assert f"<code>{parent.info.run_id}</code>" in html
    for run in children(all_runs, parent.info.run_id):
        assert ids["stages"][run.data.tags["tcnn.stage"]] == run.info.run_id
        assert f"<code>{run.info.run_id}</code>" in html


def _pct_interval(d: dict) -> str:
    """A difference with its interval in percentage points, written out here (not core's formatter)."""
    lo, mid, hi = (100 * d[k] for k in ("low", "diff", "high"))
    return f"{mid:+.2f} [{lo:+.2f}, {hi:+.2f}]"


def _assert_headline_table(shown: str, repo: Path) -> None:
    """`dvc metrics show` prints the headline, and only it: one row per model (clean accuracy and mCA in %) and
    one for T-CNN - control (clean, mCA, mCE: the readable string with its 95% interval ends, and beside it the
    same three numbers in pp, which `dvc metrics diff` subtracts; DVC orders the columns by name), the numbers of
    results/metrics.json."""
    lines = [line for line in shown.splitlines() if line.strip()]
    cells = [re.split(r"\s{2,}", line.strip()) for line in lines]  # DVC pads its columns with 2+ spaces
    diff_cols = [
        f"tcnn-control {c}{e}" for c in ("clean", "mCA", "mCE") for e in ("", " pp", " pp high", " pp low")
    ]
    assert cells[0] == ["Path", "clean", "mCA", *diff_cols], shown
    full = json.loads((repo / "results" / "metrics.json").read_text())
    rows = {row[0]: row[1:] for row in cells[1:]}
    assert set(rows) == {f"results/headline/{r}.json" for r in ("cnn", "control", "tcnn", "tcnn-control")}, (
        shown
    )
    for model in ("cnn", "control", "tcnn"):
        got = rows[f"results/headline/{model}.json"]
        want = [100 * full[model][k] for k in ("clean_accuracy", "mca")]
        assert [float(v) for v in got[:2]] == pytest.approx(want, abs=0.006) and got[2:] == ["-"] * 12, (
            model,
            got,
        )
    diffs = full["comparisons"]["tcnn-control"]
    got = rows["results/headline/tcnn-control.json"]
    assert got[:2] == ["-", "-"], shown
    for i, k in enumerate(("clean_accuracy", "mca", "mce")):
        text, point, high, low = got[2 + 4 * i : 6 + 4 * i]
        assert text == _pct_interval(diffs[k]), shown
        assert [float(point), float(low), float(high)] == pytest.approx(
            [100 * diffs[k][e] for e in ("diff", "low", "high")], abs=0.006
        ), shown


#: docs/pipeline.md's form of `dvc exp show` (the README's too): the changed params and T-CNN - control's
#: readable columns; every column named by a path, DVC's Created, State and Executor and the difference's
#: numbers dropped, so that it fits 120 columns also once an experiment was queued.
EXP_SHOW = [
    "--only-changed",
    "--drop",
    r".*/.*|Created|State|Executor|.* pp",
    "--keep",
    r"tcnn-control (clean|mCA|mCE)$",
]


def test_dvc_metrics_show_and_exp_show_print_the_headline_in_120_columns(repo: Path) -> None:
    """A fresh clone's first run: `dvc metrics show` prints the headline table; the `dvc exp show` command
    docs/pipeline.md gives sets the run's T-CNN - control beside the committed one, in 120 columns."""
    _assert_headline_table(dvc(repo, "metrics", "show").stdout, repo)
    shown = dvc(repo, "exp", "show", *EXP_SHOW, "--no-pager", COLUMNS="120").stdout
    lines = [line for line in shown.splitlines() if line.strip()]
    assert max(len(line) for line in lines) <= 120 and "…" not in shown, shown
    assert [c.strip() for c in re.split(r"\s{2,}", lines[1].strip())] == [
        "Experiment", "tcnn-control clean", "tcnn-control mCA", "tcnn-control mCE"
    ], shown  # fmt: skip
    mine = json.loads((repo / "results" / "headline" / "tcnn-control.json").read_text())
    (workspace,) = [line for line in lines if line.strip().startswith("workspace")]
    (main,) = [line for line in lines if line.strip().startswith("main")]
    assert all(v in workspace for v in mine.values() if isinstance(v, str)), shown
    assert re.split(r"\s{2,}", main.strip())[1:] == ["-"] * 3, shown  # the test repo's commit has no results


def _drawn(page: Path, tmp_path: Path) -> tuple[int, int]:
    """(plots on the page, plots drawn) with the network off: headless Chromium with every host unresolvable
    and a dead proxy; a drawn Vega view is a `marks` canvas or SVG inside its div."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium not installed (scripts/setup.sh --test installs it)"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           f"--user-data-dir={tmp_path / 'profile'}", "--host-resolver-rules=MAP * ~NOTFOUND",
           "--proxy-server=http://127.0.0.1:9", "--virtual-time-budget=20000", "--dump-dom", page.as_uri()]  # fmt: skip
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout
    wanted = len(re.findall(r"vegaEmbed\('#", page.read_text()))
    return wanted, len(re.findall(r'<(?:canvas|svg)[^>]*class="marks"', dom))


def test_dvc_plots_show_draws_offline(repo: Path, tmp_path: Path) -> None:
    """`dvc plots show` renders into the page scripts/setup.sh generated (.dvc/config plots.html_template:
    Vega, Vega-Lite and Vega-Embed inlined): every plot draws with the network off. DVC's own page (the
    libraries from a CDN) draws none: the check can fail."""
    page = REPO / "infra" / "dvc" / "plots" / "offline.html"  # scripts/dvc_plots_page.py's PAGE
    assert page.is_file(), f"{page} missing: scripts/setup.sh generates it"
    copy = tmp_path / "repo"
    shutil.copytree(repo, copy, symlinks=True)
    (copy / page.relative_to(REPO)).write_bytes(page.read_bytes())  # what set-up writes in a clone
    dvc(copy, "plots", "show", "-o", str(tmp_path / "offline"))
    wanted, drawn = _drawn(tmp_path / "offline" / "index.html", tmp_path / "a")
    assert wanted >= 7 and drawn == wanted, (wanted, drawn)
    cdn = tmp_path / "cdn.html"
    cdn.write_text("<html><head>{scripts}</head><body>{plot_divs}</body></html>")
    dvc(copy, "plots", "show", "--html-template", str(cdn), "-o", str(tmp_path / "online"))
    assert "cdn.jsdelivr.net" in (tmp_path / "online" / "index.html").read_text()
    assert _drawn(tmp_path / "online" / "index.html", tmp_path / "b") == (wanted, 0)


def test_noop_rerun_is_clean_and_opens_no_run(repo: Path) -> None:
    before = len(runs(repo))
    status = dvc(repo, "status")
    assert "Data and pipelines are up to date." in status.stdout, status.stdout
    again = dvc(repo, "repro")
    assert "Running stage" not in again.stdout
    assert len(runs(repo)) == before
    # the run-ids file and the store are no DVC outputs: nothing untracked for DVC to complain about
    assert "runs/mlflow_runs.json" not in again.stdout + again.stderr


def test_dvc_exp_run_is_its_own_parent_run_and_reruns_only_reparam_and_after(own_repo: Path) -> None:
    """`dvc exp run -S reparam.alpha_init=2`: DVC calls reparam changed and not what comes before it, reruns
    exactly reparam and the stages after it, and MLflow holds one new parent named after the experiment whose
    children are those stages."""
    repo = own_repo
    before = {r.info.run_id for r in _parents(runs(repo))}
    text = (repo / "params.yaml").read_text()
    params = yaml.safe_load(text)
    params["reparam"]["alpha_init"] = 2.0
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    changed = set(re.findall(r"^(\w+):", dvc(repo, "status").stdout, flags=re.M))
    assert "reparam" in changed and not changed & {"prepare", "pretrain", "corrupt"}, changed
    (repo / "params.yaml").write_text(text)  # dvc exp run sets the value itself
    out = dvc(repo, "exp", "run", "-S", "reparam.alpha_init=2")
    said = out.stdout + out.stderr
    name = re.search(r"Ran experiment\(s\): (\S+)", said)
    assert name, said
    ran = re.findall(r"Running stage '(\w+)'", said)
    assert ran == ["reparam", "finetune", "evaluate", "report"], said
    for stage in ("prepare", "pretrain", "corrupt"):
        assert f"Stage '{stage}' didn't change, skipping" in said
    all_runs = runs(repo)
    new = [r for r in _parents(all_runs) if r.info.run_id not in before]
    assert len(new) == 1
    parent = new[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.params["alpha_init"] == "2.0"
    assert parent.data.tags.get("tcnn.dvc_exp_name") == name.group(1) == parent.info.run_name
    kids = children(all_runs, parent.info.run_id)
    assert sorted(r.data.tags["tcnn.stage"] for r in kids) == sorted(ran)
    assert {r.info.status for r in kids} == {"FINISHED"}
    assert f"<code>{parent.info.run_id}</code>" in (repo / "results" / "report.html").read_text()
    _assert_headline_table(dvc(repo, "metrics", "show").stdout, repo)  # the experiment's own numbers
    plots = dvc(repo, "plots", "show", "--json")
    data = json.loads(plots.stdout)
    assert not data.get("errors")
    assert {"pretrain_accuracy", "gpsa_inv_alpha", "gpsa_gate", "robustness_by_category"} <= set(data["data"])


def _output_digests(repo: Path) -> dict[str, str]:
    """sha256 of every file under every stage output of the real dvc.yaml (docs/reliability.md's promise is about
    all of them)."""
    from stages.harness import chain

    values = yaml.safe_load((repo / "params.yaml").read_text())
    found: dict[str, str] = {}
    for out in chain.all_outputs(repo):
        path = repo / chain.resolve(out, values)
        for f in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if f.is_file():
                found[str(f.relative_to(repo))] = _sha256(f)
    return found


def test_a_refused_value_put_back_costs_no_stage_run_on_the_real_pipeline(own_repo: Path) -> None:
    """docs/reliability.md: DVC removes a stage's outputs before it runs the stage, so a value the stage refuses
    comes after that; the run cache brings them back. On the real dvc.yaml: a value refused at pretrain (the
    costliest stage) and one refused at evaluate, each put back, and `dvc repro` runs no stage and checks out
    every output byte for byte (the check stage's too)."""
    repo = own_repo
    text = (repo / "params.yaml").read_text()
    before = _output_digests(repo)
    assert {"runs/pretrain/cnn-final.pt", "runs/finetune/metrics.json", "results/metrics.json"} <= set(before)
    # evaluate's value passes validation and the check stage (which reads the whole robustness section, so it
    # reruns, and is had from the run cache once the value is back): a baseline file that is not there
    for stage, key, value, said_first in (
        ("pretrain", "lr", -1, "pretrain: error: params.yaml:"),
        ("evaluate", "baseline", "nope.json", "evaluate: error: robustness.baseline:"),
    ):
        params = yaml.safe_load(text)
        params["pretrain" if stage == "pretrain" else "robustness"][key] = value
        (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        bad = dvc(repo, "repro", check=False)
        said = bad.stdout + bad.stderr
        assert bad.returncode != 0 and said_first in said, said
        assert not (
            repo / "runs/pretrain/cnn-final.pt" if stage == "pretrain" else repo / "results/metrics.json"
        ).exists()
        (repo / "params.yaml").write_text(text)
        back = dvc(repo, "repro")
        said = back.stdout + back.stderr
        assert "Running stage" not in said, said
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in said, said
        assert _output_digests(repo) == before, stage
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout


def test_a_second_dvc_repro_on_a_busy_workspace_names_what_dvc_removed_and_how_it_comes_back(
    own_repo: Path,
) -> None:
    """A second `dvc repro --force` while a stage process holds the workspace: DVC removes the stage's outputs
    before the stage can refuse. The one line names them and `dvc checkout <stage>`, which brings them back."""
    import sys

    repo = own_repo
    before = _output_digests(repo)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; from core.utils.workspace import workspace_lock\n"
         "with workspace_lock(sys.argv[1], 'python -m stages.pretrain'):\n    print('held', flush=True); time.sleep(300)",
         str(repo)], stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        busy = dvc(repo, "repro", "--force", "--single-item", "reparam", check=False)
    finally:
        holder.kill()
        holder.wait()
    said = busy.stdout + busy.stderr
    line = next(ln for ln in said.splitlines() if ln.startswith("reparam: error:"))
    assert busy.returncode != 0 and f"in use by pid {holder.pid}" in line, said
    gone = "runs/reparam/tcnn.pt, runs/reparam/equivalence.json"
    assert f"DVC removed this stage's outputs before starting it ({gone})" in line, line
    assert "`dvc checkout reparam` brings them back" in line, line
    assert not (repo / "runs/reparam/tcnn.pt").exists()
    dvc(repo, "checkout", "reparam")
    assert _output_digests(repo) == before
    assert "Data and pipelines are up to date." in dvc(repo, "status").stdout
