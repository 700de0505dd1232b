"""CIFAR-10 on natural images: the JPEG archive import, CIFAR-10-C's 32 px constants and frost
texture choice as make_cifar_c.py has them, selection of the fine-tuning lr on validation data, and the study
network's map sizes. Nothing here reads ../shared: the tests make their own tiny archive."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import core.robustness.corruptions as C
from core.data import DataError, import_dataset, load_split, read_manifest
from core.robustness.eval_table import PER_IMAGE_SCHEMA, TABLE_SCHEMA

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "pipelines" / "studies" / "cifar10_lr.yaml"
CLASSES = ["airplane", "automobile", "bird"]


def make_archive(path: Path, per_class: dict[str, int], quality: int = 75, top: str = "") -> dict[str, int]:
    """A .tar.gz ImageFolder tree of 32x32 JPEGs at ``quality`` (4:2:0); returns {member: label}."""
    rng = np.random.default_rng(0)
    truth = {}
    with tarfile.open(path, "w:gz") as tar:
        for split, n in per_class.items():
            for label, cls in enumerate(CLASSES):
                for i in range(n):
                    # A class-specific colour under noise: the label is recoverable from the pixels.
                    base = np.zeros((32, 32, 3), np.uint8) + np.uint8(60 + 70 * label)
                    img = np.clip(base + rng.integers(0, 40, (32, 32, 3)), 0, 255).astype(np.uint8)
                    buf = io.BytesIO()
                    Image.fromarray(img).save(buf, "JPEG", quality=quality, subsampling=2)
                    name = f"{top}{split}/{cls}/{i:04d}.jpg"
                    info = tarfile.TarInfo(name)
                    info.size = len(buf.getvalue())
                    tar.addfile(info, io.BytesIO(buf.getvalue()))
                    truth[name] = label
    return truth


# ------------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("top", ["", "cifar10/"])
def test_archive_imports_labels_splits_and_provenance(tmp_path: Path, top: str) -> None:
    archive = tmp_path / "tiny.tar.gz"
    make_archive(archive, {"train": 4, "test": 2}, top=top)
    res = import_dataset("imagefolder", archive, tmp_path / "out", shard_rows=5)
    m = read_manifest(tmp_path / "out")
    assert m["label_names"] == CLASSES and m["num_classes"] == 3
    assert m["splits"]["train"]["num_rows"] == 12 and m["splits"]["test"]["num_rows"] == 6
    assert m["splits"]["train"]["class_counts"] == [4, 4, 4]
    src = m["source"]
    assert src["kind"] == "imagefolder-archive"
    assert src["archive_sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert src["archive_bytes"] == archive.stat().st_size
    assert src["jpeg_quality"] == {"75": 18} and src["jpeg_subsampling"] == {"4:2:0": 18}
    images, labels = load_split(tmp_path / "out", "test")
    assert images.shape == (6, 32, 32, 3)
    # Labels follow the class folders (sorted names), not the order in the archive; colour encodes class.
    assert labels.tolist() == [0, 0, 1, 1, 2, 2]
    means = [images[labels == k].mean() for k in range(3)]
    assert means[0] < means[1] < means[2]
    assert not res.skipped
    again = import_dataset("imagefolder", archive, tmp_path / "out", shard_rows=5)
    assert again.skipped  # same archive sha256: nothing re-imported


def test_jpeg_quality_is_read_from_the_quantization_tables(tmp_path: Path) -> None:
    archive = tmp_path / "q90.tar.gz"
    make_archive(archive, {"train": 2}, quality=90)
    import_dataset("imagefolder", archive, tmp_path / "out")
    assert read_manifest(tmp_path / "out")["source"]["jpeg_quality"] == {"90": 6}


def _prepare(tmp_path: Path, source: Path) -> subprocess.CompletedProcess:
    params = tmp_path / "p.yaml"
    params.write_text(
        f"data: {{name: imagefolder, source: {source}, dir: {tmp_path / 'out'}, image_size: 32}}\n"
        "tracking: {enabled: false}\n"
    )
    return subprocess.run(
        [sys.executable, "-m", "stages.prepare", "--params", str(params)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_truncated_archive_is_one_line_exit_2_nothing_written(tmp_path: Path) -> None:
    good = tmp_path / "good.tar.gz"
    make_archive(good, {"train": 3, "test": 1})
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    proc = _prepare(tmp_path, bad)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a readable tar archive" in lines[0] and str(bad) in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))


def test_missing_archive_is_one_line_exit_2_nothing_written(tmp_path: Path) -> None:
    proc = _prepare(tmp_path, tmp_path / "nowhere.tar.gz")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_no_archive_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.zip").write_bytes(b"PK")
    with pytest.raises(DataError, match="neither a directory nor"):
        import_dataset("imagefolder", tmp_path / "x.zip", tmp_path / "out")


# -------------------------------------------------------------------------------------------- CIFAR-10-C

# make_cifar_c.py (hendrycks/robustness, ImageNet-C/create_c/make_cifar_c.py), typed from its source: the
# severity 1..5 constants of each corruption. zoom_blur's are np.arange(1, stop, 0.01) (start, stop, step).
MAKE_CIFAR_C = {
    "gaussian_noise": [0.04, 0.06, 0.08, 0.09, 0.10],
    "shot_noise": [500, 250, 100, 75, 50],
    "impulse_noise": [0.01, 0.02, 0.03, 0.05, 0.07],
    "speckle_noise": [0.06, 0.1, 0.12, 0.16, 0.2],
    "gaussian_blur": [0.4, 0.6, 0.7, 0.8, 1],
    "glass_blur": [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)],
    "defocus_blur": [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)],
    "motion_blur": [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)],
    "zoom_blur": [(1, 1.06, 0.01), (1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.01), (1, 1.26, 0.01)],
    "fog": [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)],
    "frost": [(1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)],
    "snow": [(0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9), (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
             (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85), (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)],
    "spatter": [(0.62, 0.1, 0.7, 0.7, 0.5, 0), (0.65, 0.1, 0.8, 0.7, 0.5, 0), (0.65, 0.3, 1, 0.69, 0.5, 0),
                (0.65, 0.1, 0.7, 0.69, 0.6, 1), (0.65, 0.1, 0.5, 0.68, 0.6, 1)],
    "contrast": [0.75, 0.5, 0.4, 0.3, 0.15],
    "brightness": [0.05, 0.1, 0.15, 0.2, 0.3],
    "saturate": [(0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)],
    "jpeg_compression": [80, 65, 58, 50, 40],
    "pixelate": [0.95, 0.9, 0.85, 0.75, 0.65],
    # IMSIZE * (alpha, sigma, affine) with IMSIZE = 32: the table holds the factors, the code multiplies.
    "elastic_transform": [(0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)],
}  # fmt: skip


def test_cifar_band_constants_are_make_cifar_c_published_table() -> None:
    assert set(MAKE_CIFAR_C) == set(C.CORRUPTIONS)
    for name, expected in MAKE_CIFAR_C.items():
        got = C.CONSTANTS["cifar"][name]
        assert len(got) == 5, name
        for sev, (g, e) in enumerate(zip(got, expected), 1):
            assert np.allclose(np.atleast_1d(g).astype(float), np.atleast_1d(e).astype(float)), (
                name,
                sev,
                g,
                e,
            )
    assert C._FROST_SCALE["cifar"] == 0.2  # cv2.resize(frost, (0, 0), fx=0.2, fy=0.2)


def test_cifar_band_frost_draws_among_the_first_five_textures(monkeypatch) -> None:
    """make_cifar_c.py: ``idx = np.random.randint(5)`` over frost1.png ... frost6.jpg: the sixth never."""
    drawn: list[int] = []
    real = C._frost_texture

    def spy(idx: int, scale: float, gray: bool) -> np.ndarray:
        drawn.append(idx)
        return real(idx, scale, gray)

    from core.robustness import corruption_funcs

    monkeypatch.setattr(corruption_funcs, "_frost_texture", spy)
    images = np.full((400, 32, 32, 3), 128, np.uint8)
    C.corrupt_batch(images, "frost", 2, seed=3, indices=np.arange(400))
    assert set(drawn) == {0, 1, 2, 3, 4}
    drawn.clear()
    C.corrupt_batch(np.full((300, 64, 64, 3), 128, np.uint8), "frost", 2, seed=3, indices=np.arange(300))
    assert set(drawn) == {0, 1, 2, 3, 4, 5}  # the tiny band keeps all six (FROST_TEXTURES)


# ------------------------------------------------------------------------------------ selection by validation


def _summary_row(
    tid: str, seed: int, lr: float, t_val: float, t_test: float, c_val: float, c_test: float
) -> dict:
    return {"trial": tid, "seed": seed, "finetune.lr": lr, "status": "finished",
            "tcnn_val_accuracy": t_val, "tcnn_clean_accuracy": t_test,
            "control_val_accuracy": c_val, "control_clean_accuracy": c_test}  # fmt: skip


def _hand_summary() -> list[dict]:
    # Per seed, validation and test disagree on purpose: the test-best lr is never the validation-best one.
    return [
        _summary_row("a", 0, 1e-4, 0.80, 0.90, 0.84, 0.70),
        _summary_row("b", 0, 1e-3, 0.85, 0.70, 0.81, 0.95),
        _summary_row("c", 0, 1e-2, 0.82, 0.80, 0.83, 0.80),
        _summary_row("d", 1, 1e-4, 0.70, 0.99, 0.79, 0.60),
        _summary_row("e", 1, 1e-3, 0.71, 0.60, 0.78, 0.99),
        _summary_row("f", 1, 1e-2, 0.90, 0.50, 0.77, 0.98),
    ]


def test_choose_takes_the_validation_argmax_per_seed_and_arm() -> None:
    from pipelines.sweep.selection import choose

    picks = {
        (p["seed"], p["arm"]): p for p in choose(_hand_summary(), ["seed", "finetune.lr"], ["finetune.lr"])
    }
    assert {k: (p["trial"], p["finetune.lr"]) for k, p in picks.items()} == {
        (0, "tcnn"): ("b", 1e-3), (0, "control"): ("a", 1e-4),
        (1, "tcnn"): ("f", 1e-2), (1, "control"): ("d", 1e-4),
    }  # fmt: skip
    rows = _hand_summary()
    rows[0]["tcnn_val_accuracy"] = rows[1]["tcnn_val_accuracy"]  # a tie: the first trial in grid order
    assert choose(rows, ["seed", "finetune.lr"], ["finetune.lr"])[0]["trial"] == "a"


def _write_trial(root: Path, correct: dict[str, np.ndarray], corrupted: dict[str, np.ndarray]) -> None:
    """results/{robustness,per_image}.parquet of one trial: clean test images 0..N-1 and one corrupted set
    (gaussian_noise, severity 1) over every image."""
    rows, parts = [], []
    for model in correct:
        for corr, sev, arr in (("clean", 0, correct[model]), ("gaussian_noise", 1, corrupted[model])):
            n, k = len(arr), int(arr.sum())
            rows.append({"model": model, "corruption": corr, "category": "clean" if sev == 0 else "noise",
                         "severity": sev, "n": n, "correct": k, "accuracy": k / n, "error": 1 - k / n,
                         "meaningful": True})  # fmt: skip
            parts.append(pa.table({"model": [model] * n, "corruption": [corr] * n, "severity": [sev] * n,
                                   "index": np.arange(n, dtype=np.int32), "correct": arr.astype(bool)}))  # fmt: skip
    (root / "results").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=TABLE_SCHEMA), root / "results" / "robustness.parquet")
    pq.write_table(pa.concat_tables(parts).cast(PER_IMAGE_SCHEMA), root / "results" / "per_image.parquet")


def test_headline_pairs_the_validation_chosen_trials(tmp_path: Path) -> None:
    """T-CNN - control per seed is the T-CNN of its validation-chosen trial minus the control of its own
    (another trial), not the test-best pair and not one trial's own difference."""
    from pipelines.sweep.selection import over_seeds, selected_rows

    rng = np.random.default_rng(1)
    n = 200
    rows, spec = _hand_summary(), {"grid": {"seed": [0, 1], "finetune.lr": [1e-4, 1e-3, 1e-2]},
                                   "select": {"over": ["finetune.lr"], "by": "val_accuracy"}, "trials": {}}  # fmt: skip
    acc: dict[str, dict[str, float]] = {}
    for r in rows:
        d = tmp_path / r["trial"]
        p = {m: rng.uniform(0.5, 0.95) for m in ("cnn", "tcnn", "control")}
        if r["seed"] == 1:
            p["cnn"] = 0.6  # one pretrained CNN per seed: its trials agree on it
        correct = {m: rng.random(n) < v for m, v in p.items()}
        corrupted = {m: rng.random(n) < v * 0.7 for m, v in p.items()}
        _write_trial(d, correct, corrupted)
        acc[r["trial"]] = {m: float(c.mean()) for m, c in correct.items()}
        r["trial_dir"] = str(d)
        spec["trials"][r["trial"]] = {"params": {"seed": r["seed"], "robustness": {"bootstrap": 200}}}
    chosen = {s["seed"]: s for s in selected_rows(spec, rows)}
    assert (chosen[0]["tcnn_trial"], chosen[0]["control_trial"]) == ("b", "a")
    assert (chosen[1]["tcnn_trial"], chosen[1]["control_trial"]) == ("f", "d")
    for seed, (t, c) in ((0, ("b", "a")), (1, ("f", "d"))):
        want = acc[t]["tcnn"] - acc[c]["control"]
        got = chosen[seed]
        assert got["tcnn_minus_control_clean_accuracy"] == pytest.approx(want, abs=1e-12)
        assert (
            got["tcnn_minus_control_clean_accuracy_ci_low"]
            <= want
            <= got["tcnn_minus_control_clean_accuracy_ci_high"]
        )
        assert got["tcnn_clean_accuracy"] == pytest.approx(acc[t]["tcnn"])
        assert got["control_clean_accuracy"] == pytest.approx(acc[c]["control"])
        assert got["tcnn_finetune.lr"] == {"b": 1e-3, "f": 1e-2}[t]
    agg = over_seeds(list(chosen.values()))[0]
    diffs = [chosen[s]["tcnn_minus_control_clean_accuracy"] for s in (0, 1)]
    assert agg["tcnn_minus_control_clean_accuracy_seeds_mean"] == pytest.approx(np.mean(diffs))
    from scipy import stats

    half = stats.t.ppf(0.975, 1) * np.std(diffs, ddof=1) / np.sqrt(2)
    assert agg["tcnn_minus_control_clean_accuracy_seeds_ci_low"] == pytest.approx(np.mean(diffs) - half)
    assert agg["tcnn_minus_control_clean_accuracy_seeds_ci_high"] == pytest.approx(np.mean(diffs) + half)


@pytest.mark.parametrize(
    ("mean", "low", "high", "lower", "says"),
    [
        (0.02, 0.01, 0.03, False, "the T-CNN is better"),
        (-0.02, -0.03, -0.01, False, "the control is better"),
        (-0.02, -0.03, -0.01, True, "the T-CNN is better"),  # mCE: lower is better
        (0.02, 0.01, 0.03, True, "the control is better"),
        (0.01, -0.01, 0.03, False, "no difference resolved"),
    ],
)
def test_the_sentence_next_to_an_interval(mean, low, high, lower, says) -> None:
    from pipelines.sweep.selection import verdict

    assert verdict(mean, low, high, lower_is_better=lower).startswith(says)


def test_select_over_must_be_a_grid_key() -> None:
    from core.config import ConfigError
    from pipelines.sweep.sweep_params import validate_sweep_params

    with pytest.raises(ConfigError, match=r"sweep.select.over: 'finetune.lr' is not a grid key"):
        validate_sweep_params({"sweep": {"grid": {"seed": [0, 1]}, "select": {"over": ["finetune.lr"]}}})
    with pytest.raises(ConfigError, match="sweep.select.over: 'seed'"):
        validate_sweep_params({"sweep": {"grid": {"seed": [0, 1]}, "select": {"over": ["seed"]}}})
    p = validate_sweep_params(
        {"sweep": {"grid": {"finetune.lr": [1e-4, 1e-3]}, "select": {"over": ["finetune.lr"]}}}
    )
    assert p.sweep.select.over == ["finetune.lr"]


# ----------------------------------------------------------------------------------------- the network


def _study_params(tmp_path: Path):
    """The shipped preset, its data.source pointed at a file of the test's own (the preset names the copy in
    ../shared/datasets, which the tests never need)."""
    from pipelines.sweep.sweep_params import load_sweep_params

    (tmp_path / "cifar10.tar.gz").write_bytes(b"")
    return load_sweep_params(STUDY, [f"data.source={tmp_path / 'cifar10.tar.gz'}"])


def test_study_network_gives_every_gpsa_layer_an_8x8_map_at_32px(tmp_path: Path) -> None:
    from core.models.factory import build
    from core.reparam import gpsa_modules

    p = _study_params(tmp_path)
    assert p.data.image_size == 32
    model = build(p.model.kind, p.model.arch, 10).eval()
    layers = gpsa_modules(model)
    assert len(layers) >= 4
    seen: dict[str, tuple[int, ...]] = {}
    hooks = [m.register_forward_hook(lambda mod, i, o, n=n: seen.__setitem__(n, tuple(i[0].shape[-2:])))
             for n, m in layers]  # fmt: skip
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    for h in hooks:
        h.remove()
    assert set(seen) == {n for n, _ in layers}
    assert all(h >= 8 and w >= 8 for h, w in seen.values()), seen


def test_study_preset_selects_the_lr_on_validation_over_a_30x_grid(tmp_path: Path) -> None:
    p = _study_params(tmp_path)
    lrs = p.sweep.grid["finetune.lr"]
    assert len(lrs) >= 3 and max(lrs) / min(lrs) >= 30 and 1e-4 in lrs  # the paper's 1e-4 at batch 1024
    assert len(p.sweep.grid["seed"]) >= 3
    assert p.sweep.select.over == ["finetune.lr"] and p.sweep.select.by == "val_accuracy"
    assert p.finetune.control and p.robustness.n_images >= 2000 and p.data.val_size > 0


def test_gpsa_cache_keeps_autocast_values_apart() -> None:
    """An eval forward under bf16 autocast caches bf16 GEMM weights; a later fp32 forward must not reuse them
    (it crashed with 'expected m1 and m2 to have the same dtype' in the fine-tuning stage's probe)."""
    from core.models.factory import build

    model = build("tcnn", "resnet12_cifar_os16", 10).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
        again = model(x)
    assert again.dtype == torch.float32 and torch.equal(again, ref)
    assert (low.float() - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_manifest_json_of_an_archive_is_plain_json(tmp_path: Path) -> None:
    archive = tmp_path / "a.tgz"
    make_archive(archive, {"train": 1, "val": 1})
    import_dataset("imagefolder", archive, tmp_path / "out")
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["source"]["split_dirs"] == {"train": "train", "test": "val"}
