"""Stage `evaluate`: the numbers it writes, checked by hand from its own per-image table; one test resolution
for every model; the comparisons and their intervals; a config without a control."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest
import torch
from _train_helpers import TEST_DEVICE, tiny_params, write_dataset

from core.config import validate_params
from core.data import load_split, read_manifest
from core.robustness import corruptions as C
from core.robustness.evaluation import correct_per_image
from core.robustness.suite import BENCHMARK_CORRUPTIONS
from core.training.checkpoint import load_model
from stages import control, corrupt, evaluate, pretrain, robustness_bench

CORRUPTIONS = ["gaussian_noise", "contrast", "speckle_noise"]  # two benchmark corruptions and one extra


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TCNN_QUIET", "1")
    monkeypatch.setenv("TCNN_DEVICE", TEST_DEVICE)
    monkeypatch.setattr(C, "default_workers", lambda: 1)


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoints of three different networks in the places evaluate reads them (the pretraining
    run's epochs 4, 1 and 0 as CNN, control and T-CNN), plus corrupted sets of 40 test images."""
    root = tmp_path_factory.mktemp("eval")
    data = write_dataset(root / "data" / "fmnist", n_train=1100, n_test=120)
    raw = _raw(data, root)
    params = validate_params(raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the same three networks whether or not pytest-xdist shares the cores out
    try:  # (trained at one thread, the CNN's errors on 40 corrupted images did not all exceed its clean one)
        pretrain.run(params, root=root)
    finally:
        torch.set_num_threads(threads)
    ckpt = root / "runs" / "pretrain" / "ckpt"
    control.checkpoint_path(root).parent.mkdir(parents=True)
    shutil.copy(ckpt / "ckpt-epoch-001.pt", control.checkpoint_path(root))
    (root / "runs" / "finetune").mkdir(parents=True)
    shutil.copy(ckpt / "ckpt-epoch-000.pt", root / "runs" / "finetune" / "tcnn-final.pt")
    corrupt.run(params, root=root)
    return root


def _raw(data: Path, root: Path, **extra: dict) -> dict:
    return tiny_params(
        data,
        pretrain={"epochs": 4, "lr": 0.1, "checkpoint_epochs": [0, 1, 4]},
        reparam={"epoch": 4},
        robustness={"dir": str(root / "c"), "n_images": 40, "corruptions": CORRUPTIONS,
                    "severities": [1, 3], "batch_size": 50, "bootstrap": 200, **extra.get("robustness", {})},
        **{k: v for k, v in extra.items() if k != "robustness"},
    )  # fmt: skip


def _named_cifar10(raw: dict) -> dict:
    """The tiny chain's 28 px grayscale test split called cifar10, so that a CIFAR-10-C layout fits it by name
    (core.config); the published arrays are still checked against its real images."""
    raw["data"]["name"] = "cifar10"
    return raw


def _errors(per_image: dict, model: str) -> tuple[float, dict[str, dict[int, float]]]:
    """(clean error, {corruption: {severity: error}}) of one model, straight from the per-image table."""
    m = per_image["model"] == model
    clean = 1 - per_image["correct"][m & (per_image["corruption"] == "clean")].mean()
    errs: dict[str, dict[int, float]] = {}
    for c in CORRUPTIONS:
        for s in (1, 3):
            sel = m & (per_image["corruption"] == c) & (per_image["severity"] == s)
            errs.setdefault(c, {})[s] = 1 - per_image["correct"][sel].mean()
    return clean, errs


@pytest.mark.slow
def test_metrics_equal_hand_computed_values_from_the_per_image_table(chain) -> None:
    """mCE of the baseline is 1; every other model's mCE and relative mCE are computed here by hand
    (Hendrycks & Dietterich: CE_c = sum_s E / sum_s E_base, mean over the benchmark corruptions; rCE with the
    clean errors subtracted) from the stage's own per-image table, with the pretrained CNN as normaliser."""
    params = validate_params(_raw(chain / "data" / "fmnist", chain))
    metrics = evaluate.run(params, root=chain)
    table = pq.read_table(chain / "results" / "per_image.parquet")
    per_image = {k: np.asarray(table.column(k).to_pylist()) for k in table.column_names}
    assert set(per_image["model"]) == {"cnn", "control", "tcnn"}
    assert (per_image["corruption"] == "clean").sum() == 3 * 120  # the full clean test split per model

    base_clean, base = _errors(per_image, "cnn")
    bench = [c for c in CORRUPTIONS if c in BENCHMARK_CORRUPTIONS]
    assert metrics["cnn"]["mce"] == pytest.approx(1.0)
    assert all(sum(b - base_clean for b in base[c].values()) > 0 for c in bench)  # rCE is defined
    for model in ("cnn", "control", "tcnn"):
        clean, errs = _errors(per_image, model)
        ce = [sum(errs[c].values()) / sum(base[c].values()) for c in bench]
        rce = [
            sum(e - clean for e in errs[c].values()) / sum(b - base_clean for b in base[c].values())
            for c in bench
        ]
        assert metrics[model]["clean_accuracy"] == pytest.approx(1 - clean)
        assert metrics[model]["mce"] == pytest.approx(np.mean(ce), abs=1e-12)
        assert metrics[model]["relative_mce"] == pytest.approx(np.mean(rce), abs=1e-12)
        cells = [1 - e for c in bench for e in errs[c].values()]
        assert metrics[model]["mca"] == pytest.approx(np.mean(cells), abs=1e-12)
    # Differences are b - a of the point values, and their intervals contain them.
    comps = metrics["comparisons"]
    assert list(comps) == ["tcnn-control", "tcnn-cnn", "control-cnn"]
    for key, (a, b) in {"tcnn-control": ("control", "tcnn"), "tcnn-cnn": ("cnn", "tcnn")}.items():
        for name in ("clean_accuracy", "mca", "mce", "relative_mce"):
            d = comps[key][name]
            assert d["diff"] == pytest.approx(metrics[b][name] - metrics[a][name], abs=1e-12)
            assert d["low"] <= d["diff"] <= d["high"]
            assert d["excludes_zero"] == (d["low"] > 0 or d["high"] < 0)
    assert metrics["bootstrap"]["replicates"] == 200 and metrics["bootstrap"]["images"] == {
        "clean": 120, "per_corrupted_set": 40,
    }  # fmt: skip
    assert (chain / "results" / "plots" / "robustness_gain.png").stat().st_size > 1000
    header = (chain / "results" / "robustness_by_category.csv").read_text().splitlines()[0]
    assert header == "category,cnn,control,tcnn"


@pytest.mark.slow
def test_every_model_is_evaluated_at_the_fine_tuning_resolution(chain, tmp_path) -> None:
    """finetune.image_size = 32: the pretrained CNN is evaluated at 32 px too, like the fine-tuned models."""
    params = validate_params(_raw(chain / "data" / "fmnist", chain, finetune={"image_size": 32}))
    root = tmp_path / "r"
    shutil.copytree(chain / "runs", root / "runs")
    metrics = evaluate.run(params, root=root)  # data and sets are absolute paths inside `chain`
    assert metrics["test_image_size"] == 32
    manifest = read_manifest(chain / "data" / "fmnist")
    images, labels = load_split(chain / "data" / "fmnist", "test")
    table = pq.read_table(root / "results" / "per_image.parquet").to_pylist()
    got = [r["correct"] for r in table if r["model"] == "cnn" and r["corruption"] == "clean"]
    cnn = load_model(chain / "runs" / "pretrain" / "cnn-final.pt")
    want = correct_per_image(
        cnn, [(images, labels)], mean=manifest["mean"], std=manifest["std"], image_size=32
    )
    assert got == want.tolist()


@pytest.mark.slow
def test_without_a_control_only_the_pretrained_comparison(chain, tmp_path) -> None:
    params = validate_params(_raw(chain / "data" / "fmnist", chain, finetune={"control": False}))
    root = tmp_path / "r"
    shutil.copytree(chain / "runs", root / "runs")
    metrics = evaluate.run(params, root=root)
    assert "control" not in metrics and list(metrics["comparisons"]) == ["tcnn-cnn"]
    assert json.loads((root / "results" / "metrics.json").read_text())["comparisons"].keys() == {"tcnn-cnn"}


def _published_copy(chain: Path, where: Path, corruptions: list[str]) -> None:
    """A CIFAR-10-C-layout copy (``<corruption>.npy``: severities 1..5 one after the other, ``labels.npy``)
    whose every 'corrupted' image is the clean test image at the same position."""
    images, labels = load_split(chain / "data" / "fmnist", "test")
    where.mkdir(parents=True)
    for c in corruptions:
        np.save(where / f"{c}.npy", np.concatenate([images] * 5))
    np.save(where / "labels.npy", np.concatenate([labels] * 5).astype(np.uint8))


@pytest.mark.slow
def test_published_sets_next_to_the_generated_ones(chain, tmp_path) -> None:
    """robustness.public (use: add): every model is also evaluated on the published sets, with the same paired
    intervals; a published set made of clean copies must score each model's clean accuracy on exactly the
    positions it holds (an independent truth: the clean per-image rows)."""
    pub = tmp_path / "CIFAR-10-C"
    _published_copy(chain, pub, CORRUPTIONS)
    params = validate_params(_named_cifar10(_raw(chain / "data" / "fmnist", chain, robustness={
        "public": {"kind": "cifar10_c", "dir": str(pub), "use": "add", "n_images": 30}})))  # fmt: skip
    metrics = evaluate.run(params, root=chain)
    main = pq.read_table(chain / "results" / "robustness.parquet").to_pydict()
    assert set(main["corruption"]) == {"clean", *CORRUPTIONS}  # the generated sets stay the main results
    assert metrics["corrupted_sets"] == "generated"
    public = metrics["public"]
    assert public["kind"] == "cifar10_c" and public["images"]["per_corrupted_set"] == 30
    per = pq.read_table(chain / "results" / "public" / "per_image.parquet").to_pandas()
    for model in ("cnn", "control", "tcnn"):
        clean = per[(per.model == model) & (per.corruption == "clean")].set_index("index")["correct"]
        sets = per[(per.model == model) & (per.corruption != "clean")]
        positions = sorted(set(sets["index"]))
        assert len(positions) == 30
        want = clean.loc[positions].mean()
        for (c, s), grp in sets.groupby(["corruption", "severity"]):
            assert grp["correct"].mean() == pytest.approx(want), (model, c, s)
        assert public[model]["mca"] == pytest.approx(want)
    d = public["comparisons"]["tcnn-control"]["mca"]
    assert d["diff"] == pytest.approx(public["tcnn"]["mca"] - public["control"]["mca"])
    assert d["low"] <= d["diff"] <= d["high"]
    from stages.harness.catalogue import summary_metrics

    head = summary_metrics(chain)
    assert head["public_tcnn_minus_control_mca"] == pytest.approx(d["diff"])
    assert head["public_tcnn_minus_control_mca_ci_low"] == pytest.approx(d["low"])
    assert head["public_tcnn_minus_control_mca_ci_high"] == pytest.approx(d["high"])


@pytest.mark.slow
def test_published_sets_instead_of_the_generated_ones(chain, tmp_path) -> None:
    pub = tmp_path / "CIFAR-10-C"
    _published_copy(chain, pub, ["contrast"])  # only one of the configured corruptions is published
    params = validate_params(_named_cifar10(_raw(chain / "data" / "fmnist", chain, robustness={
        "public": {"kind": "cifar10_c", "dir": str(pub), "use": "replace"}})))  # fmt: skip
    metrics = evaluate.run(params, root=chain)
    assert metrics["corrupted_sets"] == "cifar10_c" and "public" not in metrics
    main = pq.read_table(chain / "results" / "robustness.parquet").to_pydict()
    assert set(main["corruption"]) == {"clean", "contrast"}
    assert metrics["bootstrap"]["images"]["per_corrupted_set"] == 40  # robustness.n_images


def test_published_sets_dir_must_exist(tmp_path) -> None:
    from core.config import ConfigError

    with pytest.raises(ConfigError, match=r"robustness.public.dir"):
        validate_params({"robustness": {"public": {"kind": "cifar10_c", "dir": str(tmp_path / "none")}}})
    with pytest.raises(ConfigError, match=r"robustness.public.kind"):
        validate_params({"robustness": {"public": {"kind": "cifar10-c", "dir": str(tmp_path)}}})


def _trial(chain: Path, where: Path, tcnn_epoch: int) -> Path:
    """A trial's directory: the chain's pretrained CNN and control, its own T-CNN (a pretraining epoch)."""
    shutil.copytree(chain / "runs", where / "runs")
    ckpt = chain / "runs" / "pretrain" / "ckpt" / f"ckpt-epoch-{tcnn_epoch:03d}.pt"
    shutil.copy(ckpt, where / "runs" / "finetune" / "tcnn-final.pt")
    return where


def _evaluated(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The models the evaluate stage runs over the full test split and corrupted sets, in call order."""
    calls: list[str] = []
    real = robustness_bench.evaluate_model

    def counted(*args, **kwargs):
        calls.append(kwargs["model_name"])
        return real(*args, **kwargs)

    monkeypatch.setattr(robustness_bench, "evaluate_model", counted)
    return calls


def _cnn_rows(root: Path, name: str) -> list[dict]:
    return [r for r in pq.read_table(root / "results" / name).to_pylist() if r["model"] == "cnn"]


@pytest.mark.slow
def test_two_trials_of_one_seed_read_one_cnn_evaluation(chain, tmp_path, monkeypatch) -> None:
    """The first trial evaluates the pretrained CNN into the store, the second reads it (its evaluate never runs
    the CNN over the sets; its check predicts the first test images again): one store entry, the same CNN
    numbers in both, and the same files as the DVC path's evaluation of the CNN in its own process."""
    params = validate_params(_raw(chain / "data" / "fmnist", chain))
    store = tmp_path / "store"
    own = evaluate.run(params, root=_trial(chain, tmp_path / "own", 0))  # the DVC path: no store
    calls = _evaluated(monkeypatch)
    first = evaluate.run(params, root=_trial(chain, tmp_path / "t0", 0), shared=store)
    assert calls == ["cnn", "control", "tcnn"]
    second = evaluate.run(params, root=_trial(chain, tmp_path / "t1", 1), shared=store)
    assert calls[3:] == ["control", "tcnn"]  # the CNN was not evaluated again
    assert own["cnn_evaluation"]["source"] == "own" and own["wall_s"] > 0
    assert first["cnn_evaluation"]["source"] == "computed" and first["cnn_evaluation"]["seconds"] > 0
    assert second["cnn_evaluation"] == {
        "key": first["cnn_evaluation"]["key"],
        "source": "shared",
        "seconds": 0.0,
    }
    assert [p.name for p in store.iterdir()] == [first["cnn_evaluation"]["key"]]
    assert own["cnn"] == first["cnn"] == second["cnn"]
    assert second["tcnn"] != first["tcnn"]  # another T-CNN, compared with the same CNN numbers
    for name in ("robustness.parquet", "per_image.parquet"):
        want = _cnn_rows(tmp_path / "own", name)
        assert _cnn_rows(tmp_path / "t0", name) == _cnn_rows(tmp_path / "t1", name) == want
        a, b = (pq.read_table(tmp_path / d / "results" / name) for d in ("own", "t0"))
        assert a.to_pylist() == b.to_pylist()  # the same trial files, shared or not
    images, labels = load_split(chain / "data" / "fmnist", "test")
    manifest = read_manifest(chain / "data" / "fmnist")
    cnn = load_model(chain / "runs" / "pretrain" / "cnn-final.pt")
    clean = correct_per_image(cnn, [(images, labels)], mean=manifest["mean"], std=manifest["std"])
    got = [
        r["correct"] for r in _cnn_rows(tmp_path / "t1", "per_image.parquet") if r["corruption"] == "clean"
    ]
    assert got == clean.tolist()  # the shared rows are this CNN's, image by image


@pytest.mark.slow
def test_a_damaged_or_disagreeing_shared_cnn_evaluation_is_not_used(
    chain, tmp_path, monkeypatch, capsys
) -> None:
    """A stored table that no longer matches its sha256 is said in one line and evaluated again (the store
    repaired); a store whose recorded predictions differ from this process's is not read: the CNN is evaluated
    in this process and the note says why."""
    from stages import cnn_evaluation as E

    params = validate_params(_raw(chain / "data" / "fmnist", chain))
    store = tmp_path / "store"
    first = evaluate.run(params, root=_trial(chain, tmp_path / "t0", 0), shared=store)
    entry = store / first["cnn_evaluation"]["key"]
    table = pq.read_table(entry / "per_image.parquet")
    flipped = table.set_column(4, "correct", pa.compute.invert(table.column("correct")))
    pq.write_table(flipped, entry / "per_image.parquet")  # a valid file, other bytes
    capsys.readouterr()
    calls = _evaluated(monkeypatch)
    again = evaluate.run(params, root=_trial(chain, tmp_path / "t1", 0), shared=store)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "damaged" in ln]
    assert lines == [f"evaluate: {entry / 'per_image.parquet'}: checksum mismatch, the file is damaged; "
                     "evaluating the CNN again"]  # fmt: skip
    assert calls[0] == "cnn" and again["cnn_evaluation"]["source"] == "computed"
    # the note says why the stored evaluation was replaced, and the sweep driver's line reads it from there
    assert (
        again["cnn_evaluation"]["reason"]
        == f"{entry / 'per_image.parquet'}: checksum mismatch, the file is damaged"
    )
    from pipelines.sweep.summary import cnn_evaluation_reason

    assert cnn_evaluation_reason({"trial_dir": str(tmp_path / "t1")}) == again["cnn_evaluation"]["reason"]
    assert cnn_evaluation_reason({"trial_dir": str(tmp_path / "t0")}) is None
    assert again["cnn"] == first["cnn"]
    assert E.verified(entry, json.loads((entry / E.RECORD).read_text())["identity"])[1] is None  # repaired

    record = json.loads((entry / E.RECORD).read_text())
    record["check"]["predictions"][3] += 1
    (entry / E.RECORD).write_text(json.dumps(record))
    third = evaluate.run(params, root=_trial(chain, tmp_path / "t2", 0), shared=store)
    note = third["cnn_evaluation"]
    assert note["source"] == "recomputed" and calls.count("cnn") == 2
    assert note["reason"] == "predicts 1 of the first 120 clean test images differently from this process"
    assert third["cnn"] == first["cnn"]
