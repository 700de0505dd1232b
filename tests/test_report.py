"""Stage `report`: a tiny chain built with the producers' own writers, then the HTML and PNGs checked."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _train_helpers import TEST_DEVICE, tiny_params, write_params
from PIL import Image

from core.analysis.dissect import layer_stats as gpsa_stats
from core.analysis.dissect import long_rows as gpsa_long_rows
from core.config import validate_params
from core.data.importers import write_array_dataset
from core.models.factory import build
from core.models.spec import make_model_spec
from core.reparam import gpsa_modules, to_tcnn
from core.robustness.baseline import Baseline
from core.robustness.corruptions import CORRUPTIONS, write_set
from core.robustness.eval_table import table_from_errors
from core.robustness.metrics import flat_metrics, summarize
from core.robustness.paired_bootstrap import comparisons
from core.training.checkpoint import atomic_save
from core.utils.atomic import atomic_write_json
from core.viz.plots import plot_gains
from core.viz.report_html import section_runs
from stages import report, report_inputs
from stages.harness import training as T
from stages.harness.runner import StageError

LABELS = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"]
PARENT = "0123456789abcdef0123456789abcdef"


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = np.arange(n, dtype=np.int64) % 10
    x = rng.integers(0, 50, size=(n, 28, 28, 1)).astype(np.uint8)
    for i in range(n):  # a bright object whose size depends on the class
        x[i, 6 : 14 + y[i], 9:19] = 200
    return x, y


def _model_ckpt(model: torch.nn.Module, spec: dict, manifest: dict) -> dict:
    return {"kind": "model", "model": T.cpu_state(model), "model_spec": spec,
            "normalization": {"mean": manifest["mean"], "std": manifest["std"]}, "image_size": 28}  # fmt: skip


def build_chain(root: Path) -> dict:
    """runs/, results/ and data/ as the stages write them (formats from their writers), on a random CNN.
    Params name root-relative paths, so a copy of the tree is a chain of its own."""
    data_dir, cdir = root / "data" / "fm", root / "data" / "fm-c"
    test = _images(12, 1)
    manifest = write_array_dataset("fashion_mnist", data_dir, {"train": _images(40, 0), "test": test}, LABELS,
                                   {"kind": "test", "path": str(data_dir)}, "test", 256, None)  # fmt: skip
    write_set(cdir / "clean.parquet", test[0][5:], test[1][5:], np.arange(5, 12), {"corruption": "clean"})
    raw = tiny_params(Path("data/fm"), robustness={"dir": "data/fm-c"}, reparam={"epoch": 2, "alpha_init": 50.0,
                      "lambda_init": 50.0}, pretrain={"epochs": 2})  # fmt: skip
    raw["tracking"] = {"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "report-test"}
    params = validate_params(raw)

    torch.manual_seed(0)
    cnn = build("cnn", "resnet10_cifar", 10, in_chans=1).eval()
    spec = make_model_spec("cnn", "resnet10_cifar", 10, 1)
    tspec = make_model_spec("tcnn", "resnet10_cifar", 10, 1, tcnn={"alpha_init": 50.0, "lambda_init": 50.0,
                            "stages": [-1], "stride_mode": "exact"})  # fmt: skip
    tcnn = to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0).eval()
    x = (torch.from_numpy(test[0]).permute(0, 3, 1, 2).float() / 255 - manifest["mean"][0]) / manifest["std"][
        0
    ]
    with torch.no_grad():
        lc, lt = cnn(x), tcnn(x)
    y = torch.from_numpy(test[1])
    eq = {"reparam_epoch": 2, "alpha_init": 50.0, "lambda_init": 50.0, "stride_mode": "exact", "stages": [-1],
          "converted": True, "probe_images": 12, "max_abs_logit_diff": float((lt - lc).abs().max()),
          "mean_abs_logit_diff": float((lt - lc).abs().mean()), "max_abs_logit_cnn": float(lc.abs().max()),
          "prediction_agreement": float((lc.argmax(1) == lt.argmax(1)).float().mean()),
          "gpsa_layers": [n for n, _ in gpsa_modules(tcnn)], "params_cnn": 1, "params_tcnn": 2,
          "max_abs_logit_diff_s1": 0.123456, "val_acc_cnn": 0.3125, "val_acc_tcnn": 0.3125,
          "test_acc_cnn": float((lc.argmax(1) == y).float().mean()),
          "test_acc_tcnn": float((lt.argmax(1) == y).float().mean())}  # fmt: skip
    atomic_save(_model_ckpt(tcnn, tspec, manifest), root / "runs" / "reparam" / "tcnn.pt")
    atomic_write_json(root / "runs" / "reparam" / "equivalence.json", eq)

    pre_hist = [{"epoch": e, "step": 2 * e, "lr": 0.05 * (3 - e), "train_loss": 2.3 - 0.4 * e,
                 "train_acc": 0.1 + 0.2 * e, "images_per_s": 100.0, "train_time_s": 0.4, "val_loss": 2.2 - 0.3 * e,
                 "val_acc": 0.15 + 0.1 * e} for e in (1, 2)]  # fmt: skip
    pre_metrics = {"train_loss": 1.5, "train_acc": 0.5, "val_loss": 1.6, "val_acc": 0.35, "test_loss": 1.7,
                   "test_acc": 0.4321, "epochs": 2, "train_time_s": 0.8, "device": "cpu"}  # fmt: skip
    T.publish(None, root / "runs" / "pretrain", objects={"cnn-final.pt": _model_ckpt(cnn, spec, manifest)},
              history=pre_hist, metrics=pre_metrics)  # fmt: skip

    # "fine-tuning": gates and spans drift per head over 3 epochs; the stats come from the real gpsa_stats
    ft = to_tcnn(cnn, alpha_init=50.0, lambda_init=50.0).eval()
    hist = []
    for e in range(4):
        with torch.no_grad():
            for _, m in gpsa_modules(ft):
                drift = torch.linspace(-1.5, 1.0, m.num_heads) * e
                m.gating_param.copy_(torch.full((9,), 2.0) + drift * 2)
                m.set_positional(alpha=(50.0 * torch.exp(-0.9 * drift.abs() * e)).clamp(min=0.05),
                                 centers=m.tap_offsets())  # fmt: skip
                m.qkv_weight[: 2 * m.num_heads * m.qk_head_dim].mul_(4.0 if e else 1.0)
        row = {
            "epoch": e,
            "finetune_epoch": e,
            "step": 2 * e,
            "val_loss": 1.5 - 0.1 * e,
            "val_acc": 0.4 + 0.05 * e,
        }
        if e:
            row.update(lr=1e-5 * (4 - e), train_loss=1.6 - 0.1 * e, train_acc=0.38 + 0.05 * e)
        row["gpsa"] = gpsa_stats(ft, x[:2])
        hist.append(row)
    ft_metrics = {"mode": "fresh", "epochs_run": 3, "train_acc": 0.53, "val_acc": 0.55, "test_acc": 0.5678,
                  "test_loss": 1.2, "train_time_s": 1.5, "device": "cpu"}  # fmt: skip
    T.publish(None, root / "runs" / "finetune", objects={"tcnn-final.pt": _model_ckpt(ft, tspec, manifest)},
              history=hist, csvs={"gpsa.csv": gpsa_long_rows(hist)}, metrics=ft_metrics)  # fmt: skip

    # the matched control: the same CNN fine-tuned without attention (history rows like the finetune stage's)
    ctl_hist = [{k: v for k, v in r.items() if k != "gpsa"} for r in hist]
    ctl_metrics = {"enabled": True, "mode": "fresh", "epochs_run": 3, "train_acc": 0.52, "val_acc": 0.54,
                   "test_acc": 0.5432, "test_loss": 1.25, "train_time_s": 0.9, "device": "cpu"}  # fmt: skip
    T.publish(None, root / "runs" / "control", history=ctl_hist, metrics=ctl_metrics)

    # results/ as stages/evaluate.py writes them: the pretrained CNN (the CE baseline), the control (errors
    # 0.95x the CNN's) and the T-CNN (0.9x); intervals from made-up bootstrap replicates around the points
    rng = np.random.default_rng(2)
    errs = {c: sorted(rng.uniform(0.2, 0.8, 5)) for c in CORRUPTIONS}
    table = pa.concat_tables([
        table_from_errors("cnn", 0.2, errs, n=10),
        table_from_errors("control", 0.19, {c: [e * 0.95 for e in v] for c, v in errs.items()}, n=10),
        table_from_errors("tcnn", 0.18, {c: [e * 0.9 for e in v] for c, v in errs.items()}, n=10),
    ])  # fmt: skip
    base = Baseline.from_table(table, model="cnn", name="cnn (this run)")
    summaries = {m: summarize(table, base, model=m) for m in ("cnn", "control", "tcnn")}
    res = root / "results"
    (res / "plots").mkdir(parents=True)
    pq.write_table(table, res / "robustness.parquet")
    points = {m: flat_metrics(s) for m, s in summaries.items()}
    samples = {m: {k: v + rng.normal(0, 0.003, 200) for k, v in p.items()} for m, p in points.items()}
    comps = comparisons(points, samples, [("control", "tcnn"), ("cnn", "tcnn"), ("cnn", "control")])
    plot_gains(comps, ["tcnn-control", "tcnn-cnn"], res / "plots" / "robustness_gain.png")
    metrics = dict(points)
    metrics["baseline"] = base.name
    metrics["test_image_size"] = 28
    metrics["comparisons"] = comps
    metrics["bootstrap"] = {"replicates": 200, "images": {"clean": 12, "per_corrupted_set": 10}}
    atomic_write_json(res / "metrics.json", metrics)
    atomic_write_json(res / "summary.json", summaries)
    return {"params": params, "raw": raw, "eq": eq, "metrics": metrics, "history": hist, "manifest": manifest}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("chain")
    return root, build_chain(root)


@pytest.fixture(scope="module")
def rendered(chain, tmp_path_factory) -> tuple[Path, dict, dict, str]:
    """The stage run once on a copy of the full chain (with a run-ids file)."""
    src, info = chain
    root = tmp_path_factory.mktemp("full") / "r"
    shutil.copytree(src, root)
    atomic_write_json(root / "runs" / "mlflow_runs.json", {"parent": PARENT, "stages": {"pretrain": "run-pre-1",
                      "finetune": "run-ft-2", "evaluate": "run-ev-3"}})  # fmt: skip
    out = report.run(info["params"], root=root)
    return root, info, out, (root / "results" / "report.html").read_text()


def _pct(v: float, d: int = 2) -> str:
    return f"{100 * v:.{d}f}%"


def _png(path_or_bytes) -> Image.Image:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else Path(path_or_bytes).read_bytes()
    im = Image.open(io.BytesIO(data))
    im.load()
    assert im.format == "PNG"
    assert np.asarray(im.convert("L"), dtype=float).std() > 5
    return im


# ------------------------------------------------------------------------------------------------ content
def test_report_shows_the_numbers_of_its_inputs(rendered) -> None:
    _, info, out, text = rendered
    eq, m = info["eq"], info["metrics"]
    assert f"{eq['max_abs_logit_diff']:.3e}" in text
    assert eq["max_abs_logit_diff"] <= 1e-4 and "float precision" in text  # alpha = lambda = 50 equivalence
    assert f"{eq['max_abs_logit_diff_s1']:.3e}" in text
    assert f"{_pct(eq['test_acc_cnn'])} / {_pct(eq['test_acc_tcnn'])}" in text
    assert "layer4.0.conv1, layer4.0.conv2" in text
    for model in ("cnn", "control", "tcnn"):
        assert _pct(m[model]["clean_accuracy"]) in text
        assert _pct(m[model]["mca"]) in text
        assert _pct(m[model]["mce"], 1) in text
        assert _pct(m[model]["relative_mce"], 1) in text
        assert _pct(m[model]["extra_accuracy"]) in text
    # T-CNN errors are 0.9x the CNN's (the baseline): mCE 90%
    assert m["tcnn"]["mce"] == pytest.approx(0.9) and "90.0%" in text
    for a, b in (("control", "tcnn"), ("cnn", "tcnn"), ("cnn", "control")):  # differences with intervals
        for key in ("clean_accuracy", "mca", "mce", "mca_blur", "mca_sev3"):
            d = m["comparisons"][f"{b}-{a}"][key]
            assert d["diff"] == pytest.approx(m[b][key] - m[a][key])
            assert f"{100 * d['diff']:+.2f} pp [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]" in text
    g = m["comparisons"]["tcnn-control"]["gain_blur"]  # [TCNN21] Fig. 3's relative gain, with its interval
    assert g["diff"] == pytest.approx(m["tcnn"]["mca_blur"] / m["control"]["mca_blur"] - 1)
    assert f"{100 * g['diff']:+.2f} % [{100 * g['low']:+.2f}, {100 * g['high']:+.2f}]" in text
    # The report leads with T-CNN vs its control and says in words what the interval means.
    lead = text[text.index('id="attention"') : text.index('id="mlflow"')]
    assert "matched control" in lead and "Clean accuracy (T-CNN − control)" in lead
    assert ("excludes 0" in lead) and ("better than the control" in lead or "worse than the control" in lead)
    assert "43.21%" in text and "56.78%" in text and "54.32%" in text  # pretrain / T-CNN / control test acc.
    assert "alpha_init: 50.0" in text  # the config block
    assert out["figures"] == {"training_curves": True, "fig3": True, "fig4": True, "fig5": True, "contours": True,
                              "nonlocality": True}  # fmt: skip
    assert out["notes"] == []


def test_report_lists_mlflow_run_ids(rendered) -> None:
    _, _, out, text = rendered
    assert out["run_ids"] == {"parent": PARENT, "pretrain": "run-pre-1", "finetune": "run-ft-2",
                              "evaluate": "run-ev-3"}  # fmt: skip
    for rid in out["run_ids"].values():
        assert f"<code>{rid}</code>" in text
    assert text.index(PARENT) < text.index("run-pre-1") < text.index("run-ft-2") < text.index("run-ev-3")
    assert "report-test" in text


def test_fig4_table_matches_the_gpsa_history(rendered) -> None:
    _, info, _, text = rendered
    hist = info["history"]
    for layer in ("layer4.0.conv1", "layer4.0.conv2"):
        g0, g3 = (float(np.mean(hist[e]["gpsa"][layer]["gate"])) for e in (0, 3))
        a0, a3 = (float(np.mean(hist[e]["gpsa"][layer]["inv_alpha"])) for e in (0, 3))
        row = re.search(rf"<tr><td>{re.escape(layer)}</td>(.*?)</tr>", text).group(1)
        assert f"{g0:.3g} → {g3:.3g}" in row and f"{a0:.3g} → {a3:.3g}" in row


def test_report_figures_are_written_and_embedded(rendered) -> None:
    root, _, out, text = rendered
    embedded = [
        base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    ]
    assert len(embedded) == 6
    plots = root / "results" / "plots"
    files = {k: (plots / n).read_bytes() for k, n in report.FIGURES.items()}
    # embedded in section order: training curves, Fig. 3 (the evaluate stage's own PNG), Fig. 4, Fig. 5, contours,
    # nonlocality
    assert embedded == [files["training_curves"], (plots / "robustness_gain.png").read_bytes(), files["fig4"],
                        files["fig5"], files["contours"], files["nonlocality"]]  # fmt: skip
    sizes = {k: _png(v).size for k, v in files.items()}
    assert sizes["training_curves"][0] >= 1000 and sizes["fig4"][1] >= 500 and sizes["fig5"][0] >= 1000
    assert out["report"].endswith("results/report.html")
    assert (root / "results" / "report.html").stat().st_mode & 0o777 == 0o644  # shareable, not mkstemp's 0600
    assert not list(root.rglob("*.tmp"))


def test_fig5_data_is_the_attention_of_the_centre_query(rendered) -> None:
    _, _, out, text = rendered
    att = {a["layer"]: a for a in out["attention"]}
    assert att["layer4.0.conv1"]["grid"] == "7x7" and att["layer4.0.conv2"]["query"] == "(1, 1)"
    for a in att.values():  # a map's sum over the keys: 1 minus what the wide heads put on the zero padding
        assert 0.0 < a["mass"] <= 1 + 1e-9 and 0.0 < a["peak"] <= 1.0
    assert "label 5 (sandal)" in text  # clean set's first image is test index 5


# ------------------------------------------------------------------------------------------------ degraded
def test_missing_optional_inputs_become_notes(chain, tmp_path) -> None:
    src, info = chain
    root = tmp_path / "r"
    shutil.copytree(src, root)
    for rel in ("runs/finetune/gpsa.csv", "runs/reparam/equivalence.json", "runs/pretrain/history.json",
                "runs/finetune/history.json", "results/plots/robustness_gain.png", "data/fm-c/clean.parquet"):  # fmt: skip
        (root / rel).unlink()
    out = report.run(info["params"], root=root, run_ids={})
    text = (root / "results" / "report.html").read_text()
    for rel in ("runs/finetune/gpsa.csv", "runs/reparam/equivalence.json", "runs/pretrain/history.json"):
        assert f"{rel} is missing" in text
    assert "redrawn from results/metrics.json" in text  # Fig. 3 from the comparisons
    assert out["figures"] == {"training_curves": False, "fig3": True, "fig4": False, "fig5": True, "contours": True,
                              "nonlocality": False}  # fmt: skip
    assert "label 0 (t-shirt)" in text and "test split, index 0" in text  # fell back to the data dir
    assert "No MLflow run ids" in text
    for name in report.FIGURES.values():  # placeholders keep the declared outputs
        assert Image.open(root / "results" / "plots" / name).format == "PNG"


OPTIONAL = ("runs/finetune/gpsa.csv", "runs/reparam/equivalence.json", "runs/pretrain/history.json",
            "runs/finetune/history.json", "results/plots/robustness_gain.png", "results/robustness.parquet")  # fmt: skip


def _bare_copy(src: Path, dst: Path) -> Path:
    """The chain with only the required inputs and the images (quick to render: figures become notes)."""
    shutil.copytree(src, dst)
    for rel in OPTIONAL:
        (dst / rel).unlink()
    return dst


def test_no_gpsa_layer(chain, tmp_path) -> None:
    src, info = chain
    root = _bare_copy(src, tmp_path / "r")
    shutil.copy(root / "runs/pretrain/cnn-final.pt", root / "runs/finetune/tcnn-final.pt")  # model.kind=cnn
    out = report.run(info["params"], root=root)
    assert out["figures"] == {"training_curves": False, "fig3": True, "fig4": False, "fig5": False, "contours": False,
                              "nonlocality": False}  # fmt: skip
    assert "no attention layer" in " ".join(out["notes"]) and out["attention"] == []
    assert "results/plots/robustness_gain.png is missing; redrawn from results/metrics.json" in " ".join(
        out["notes"]
    )


def test_no_test_images(chain, tmp_path) -> None:
    src, info = chain
    root = _bare_copy(src, tmp_path / "r")
    shutil.rmtree(root / "data")
    out = report.run(info["params"], root=root)
    assert out["figures"]["fig5"] is False
    assert "No clean test image available (data/fm/manifest.json: missing" in " ".join(out["notes"])
    text = (root / "results" / "report.html").read_text()
    assert (
        "No clean test image" in text and text.count("data:image/png;base64,") == 1
    )  # Fig. 3 (metrics.json)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "rel", ["runs/pretrain/cnn-final.pt", "runs/finetune/tcnn-final.pt", "results/metrics.json"]
)
def test_missing_required_input_is_one_line_and_writes_nothing(
    chain, tmp_path, rel, monkeypatch, capsys
) -> None:
    src, info = chain
    root = tmp_path / "r"
    shutil.copytree(
        src, root, ignore=shutil.ignore_patterns("report.html", "fig*.png", "training_curves.png")
    )
    (root / rel).unlink()
    params = write_params(root / "params.yaml", info["raw"])
    monkeypatch.chdir(root)
    assert report.main(["--params", str(params)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("report: error: missing required input") and "\n" not in err and rel in err
    assert not (root / "results" / "report.html").exists()
    assert not list((root / "results" / "plots").glob("fig*.png"))


@pytest.mark.parametrize(
    "damage", ["truncated_ckpt", "bad_json", "not_metrics", "bad_equivalence", "no_comparisons", "no_control"]
)
def test_corrupt_required_input(chain, tmp_path, damage) -> None:
    src, info = chain
    root = tmp_path / "r"
    shutil.copytree(src, root)
    if damage == "truncated_ckpt":
        p = root / "runs/finetune/tcnn-final.pt"
        p.write_bytes(p.read_bytes()[:4000])
        match = "tcnn-final.pt: corrupt or truncated"
    elif damage == "bad_json":
        (root / "results/metrics.json").write_text("{not json")
        match = "metrics.json: not valid JSON"
    elif damage == "bad_equivalence":  # an optional input present but damaged: refused, not read as missing
        (root / "runs/reparam/equivalence.json").write_text('{"max_abs_logit_diff": 0.1')
        match = "equivalence.json: not valid JSON"
    elif damage in ("no_comparisons", "no_control"):
        m = json.loads((root / "results/metrics.json").read_text())
        if damage == "no_comparisons":
            del m["comparisons"]
            match = "metrics.json: lacks its comparisons"
        else:
            del m["control"]
            match = "metrics.json: has no matched control, but the params have one"
        (root / "results/metrics.json").write_text(json.dumps(m))
    else:
        (root / "results/metrics.json").write_text(json.dumps({"baseline": "x"}))
        match = "expected an object of per-model metrics"
    with pytest.raises(StageError, match=match):
        report.run(info["params"], root=root)
    assert not (root / "results" / "report.html").exists()


# ------------------------------------------------------------------------------------------------ run ids
def test_read_run_ids(tmp_path) -> None:
    assert report_inputs.read_run_ids(tmp_path) == (None, None)
    f = tmp_path / "runs" / "mlflow_runs.json"
    f.parent.mkdir()
    f.write_text(json.dumps({"parent_run_id": "p1", "pretrain": "a", "finetune_run_id": "b", "n": 3}))
    assert report_inputs.read_run_ids(tmp_path) == ({"parent": "p1", "pretrain": "a", "finetune": "b"}, None)
    f.write_text("[1, 2")
    ids, note = report_inputs.read_run_ids(tmp_path)
    assert ids is None and "unreadable" in note
    f.write_text("[1, 2]")
    ids, note = report_inputs.read_run_ids(tmp_path)
    assert ids is None and "expected a JSON object" in note


def test_run_ids_file_written_by_the_tracking_layer(tmp_path) -> None:
    """stages.harness.stage_run.record_run_ids writes what the report reads; its meta shows as the UI location."""
    from stages.harness.stage_run import record_run_ids

    f = tmp_path / "runs" / "mlflow_runs.json"
    meta = {
        "experiment": "tcnn",
        "experiment_id": "7",
        "tracking_uri": "sqlite:///x.db",
        "dvc_exp_name": "fun-cat",
    }
    record_run_ids(f, "P1", "prepare", "r1", meta)
    record_run_ids(f, "P1", "report", "r2", meta)
    assert report_inputs.read_run_ids(tmp_path) == ({"parent": "P1", "prepare": "r1", "report": "r2"}, None)
    assert report_inputs.read_run_meta(tmp_path)["dvc_exp_name"] == "fun-cat"
    record_run_ids(f, "P2", "reparam", "r3", meta)  # another execution: the file starts over
    assert report_inputs.read_run_ids(tmp_path) == ({"parent": "P2", "reparam": "r3"}, None)
    html = section_runs({"parent": "P2"}, {"tracking": {}}, None, report_inputs.read_run_meta(tmp_path))
    assert "fun-cat" in html
    # every link opens the training workflow; the runs table with the saved headline view; the ids are links
    ui = "http://127.0.0.1:5000/#/experiments/7/runs"
    assert f'<a href="{ui}/P2?workflowType=machine_learning"><code>P2</code></a>' in html
    assert f'<a href="{ui}?workflowType=machine_learning&amp;viewStateShareKey=tcnn-headline">' in html
    assert "--backend-store-uri sqlite:///x.db" in html  # how to serve the local store
    served = {**report_inputs.read_run_meta(tmp_path), "tracking_uri": "http://mlflow.lab:8080/"}
    html = section_runs({"parent": "P2"}, {"tracking": {}}, None, served)
    assert '<a href="http://mlflow.lab:8080/#/experiments/7/runs/P2?workflowType=machine_learning">' in html
    assert "--backend-store-uri" not in html  # a server: its own address, nothing to start


def test_the_local_ui_port_follows_tcnn_mlflow_port(tmp_path, monkeypatch) -> None:
    """Issue 59 (15): the report's links and its "serve it first" line name the port of TCNN_MLFLOW_PORT (what
    infra/mlflow/server.sh serves on), 5000 without it; a value that is not a port is one line, exit 2."""
    from core.config import ConfigError
    from core.utils import mlflow_ui

    meta = {"experiment_id": "7", "tracking_uri": "sqlite:///x.db"}
    monkeypatch.setenv("TCNN_MLFLOW_PORT", "5123")
    html = section_runs({"parent": "P2"}, {"tracking": {}}, None, meta)
    assert '<a href="http://127.0.0.1:5123/#/experiments/7/runs/P2?workflowType=machine_learning">' in html
    assert "--backend-store-uri sqlite:///x.db --host 127.0.0.1 --port 5123</code>" in html
    assert "5000" not in html
    monkeypatch.delenv("TCNN_MLFLOW_PORT")
    assert "--port 5000</code>" in section_runs({"parent": "P2"}, {"tracking": {}}, None, meta)
    for bad in ("http", "0", "70000"):
        monkeypatch.setenv("TCNN_MLFLOW_PORT", bad)
        with pytest.raises(ConfigError, match="TCNN_MLFLOW_PORT"):
            mlflow_ui.local_ui()


# ------------------------------------------------------------------------------------------------ real chain
@pytest.mark.slow
def test_report_on_the_real_chain(tmp_path, monkeypatch) -> None:
    """prepare-format data -> the real pretrain, reparam, finetune, corrupt and evaluate stages -> report."""
    from _train_helpers import write_dataset

    from stages import control, corrupt, evaluate, finetune, pretrain, reparam

    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)
    monkeypatch.chdir(tmp_path)  # the training stages read data.dir relative to the working directory
    write_dataset(tmp_path / "data" / "fm", n_train=300, n_test=100)
    raw = tiny_params(Path("data/fm"), pretrain={"epochs": 1}, reparam={"epoch": 1}, finetune={"epochs": 1},
                      robustness={"dir": "data/fm-c", "n_images": 40, "corruptions": ["gaussian_noise", "contrast"],
                                  "severities": [1, 3], "workers": 1})  # fmt: skip
    raw["data"]["val_size"] = 50
    params = validate_params(raw)
    for stage in (pretrain, reparam, finetune, control, corrupt, evaluate):
        stage.run(params, root=tmp_path)
    out = report.run(params, root=tmp_path)
    text = (tmp_path / "results" / "report.html").read_text()
    assert out["figures"] == {"training_curves": True, "fig3": True, "fig4": True, "fig5": True, "contours": True,
                              "nonlocality": True}  # fmt: skip
    assert out["notes"] == [] and out["run_ids"] == {}
    eq = json.loads((tmp_path / "runs/reparam/equivalence.json").read_text())
    metrics = json.loads((tmp_path / "results/metrics.json").read_text())
    assert f"{eq['max_abs_logit_diff']:.3e}" in text
    assert f"{_pct(eq['val_acc_cnn'])} / {_pct(eq['val_acc_tcnn'])}" in text
    for m in ("cnn", "control", "tcnn"):
        assert _pct(metrics[m]["clean_accuracy"]) in text and _pct(metrics[m]["mca"]) in text
    for stage in ("finetune", "control"):
        assert _pct(json.loads((tmp_path / f"runs/{stage}/metrics.json").read_text())["test_acc"]) in text
    for name in report.FIGURES.values():
        _png(tmp_path / "results" / "plots" / name)
