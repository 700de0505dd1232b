"""Bad inputs refused before any compute: a network the dataset's images cannot go through is one
line, exit 2, no MLflow run and nothing written, found by building it and running one image through it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _train_helpers import stage_env, tiny_params, write_dataset, write_params

from core.config import Params
from stages.harness.pretraining import check_network
from stages.harness.runner import StageError


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("bad") / "data", n_train=100, n_test=20)


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"model.options": {"drop_rate": 2}}, "model: tcnn/resnet10_cifar with options {'drop_rate': 2} does not "
         "take this dataset's 1-channel 28 px images (ValueError: dropout probability has to be between 0 and 1"),
        ({"model.options": {"in_chans": 3}}, "model.options.in_chans: 3, but the dataset's images have 1 channel"),
        ({"model.kind": "cnn", "model.arch": "vit_tiny_patch16_224"}, "model: cnn/vit_tiny_patch16_224 with "
         "options {} does not take this dataset's 1-channel 28 px images (AssertionError: Input height (28)"),
    ],
)  # fmt: skip
def test_a_network_the_images_cannot_go_through_is_refused(data: Path, change: dict, fragment: str) -> None:
    params = Params.model_validate(tiny_params(data)).with_overrides(change)
    with pytest.raises(StageError) as info:
        check_network(params, Path("/"))
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_networks_that_fit_pass(data: Path) -> None:
    base = Params.model_validate(tiny_params(data))
    for change in ({}, {"model.kind": "cnn", "model.arch": "resnet18"}, {"model.options": {"in_chans": 1}}):
        check_network(base.with_overrides(change), Path("/"))


def test_the_stage_refuses_before_any_run_opens(tmp_path: Path, data: Path) -> None:
    raw = tiny_params(data, tracking={"enabled": True, "uri": "sqlite:///mlruns.db", "experiment": "t"})
    write_params(tmp_path / "params.yaml", raw)
    proc = subprocess.run([sys.executable, "-m", "stages.pretrain", "-S", "model.options={drop_rate: 2}"],
                          cwd=tmp_path, env=stage_env(TCNN_TRACKING="1"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip() and " INFO mlflow." not in ln]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("pretrain: error: model: tcnn/resnet10_cifar with options {'drop_rate': 2}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


#: The tiny test split is Fashion-MNIST's 28 px grayscale; the layout tests call it cifar10 so that a CIFAR-10-C
#: layout fits it by name (config), and check the arrays against its real images
#: (stages.published_check.check_public_sets).
FITS_BY_NAME = "cifar10"


def _sets(root: Path, n: int, seed: int) -> None:
    import numpy as np

    from core.robustness import corruptions as C

    rng = np.random.default_rng(0)
    images, labels, idx = (
        rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
        rng.integers(0, 10, n),
        np.arange(n),
    )
    for sev in (1, 2):
        meta = C.set_meta("contrast", sev, seed=seed, band="cifar", image_shape=[28, 28, 1], n=n, source="x")
        C.write_set(C.set_path(root, "contrast", sev), images, labels, idx, meta)


def test_evaluate_refuses_sets_made_for_other_params(tmp_path: Path, data: Path) -> None:
    """Asked for more images per set than the corrupt stage made, evaluate evaluated fewer and recorded the
    number asked; sets of another seed were read as this config's. Both are refused before any model loads."""
    from stages.robustness_bench import check_generated_sets

    _sets(tmp_path / "c", 40, seed=0)
    params = Params.model_validate(tiny_params(data, robustness={"dir": str(tmp_path / "c"), "n_images": 40,
                                                                 "corruptions": ["contrast"], "severities": [1, 2]}))  # fmt: skip
    check_generated_sets(params, Path("/"))
    for change, says in (({"robustness.n_images": 80}, "holds 40 images of seed 0; the params ask for 80 of seed 0"),
                         ({"seed": 3}, "holds 40 images of seed 0; the params ask for 40 of seed 3"),
                         ({"robustness.severities": [1, 3]}, "contrast/3.parquet is missing or damaged")):  # fmt: skip
        with pytest.raises(StageError, match="robustness.dir: ") as info:
            check_generated_sets(params.with_overrides(change), Path("/"))
        assert says in str(info.value) and "(run the corrupt stage)" in str(info.value)


@pytest.mark.parametrize(
    "damage,says",
    [
        ("resized", "contrast.npy: uint8 [10, 32, 32, 3]; the clean test images are uint8 [N, 28, 28, 1]"),
        (
            "channels_first",
            "contrast.npy: uint8 [10, 1, 28, 28]; the clean test images are uint8 [N, 28, 28, 1]",
        ),
        ("float_labels", "labels.npy: labels must be integers, got float64"),
        ("labels_out_of_range", "labels.npy: labels 0..109 outside the dataset's 0..9"),
        ("no_labels", "labels.npy: not found"),
        ("not_npy", "contrast.npy: not a valid .npy file"),
    ],
)
def test_published_sets_that_do_not_fit_the_dataset_are_refused_before_evaluation(
    tmp_path: Path, data: Path, damage: str, says: str
) -> None:
    """CIFAR-10-C-layout sets were resized, truncated to int, scored with impossible labels or failed
    in torch after the first model's clean pass; each is now one line naming the file, before any model."""
    import numpy as np

    from stages.published_check import check_public_sets

    pub = tmp_path / "pub"
    pub.mkdir()
    shape = {"resized": (10, 32, 32, 3), "channels_first": (10, 1, 28, 28)}.get(damage, (10, 28, 28, 1))
    np.save(pub / "contrast.npy", np.zeros(shape, np.uint8))
    labels = np.arange(10) % 10
    labels = {
        "float_labels": labels.astype(np.float64),
        "labels_out_of_range": labels + 100 * (labels == 9),
    }.get(damage, labels)
    if damage != "no_labels":
        np.save(pub / "labels.npy", labels)
    if damage == "not_npy":
        (pub / "contrast.npy").write_bytes(b"not an array")
    raw = tiny_params(data, robustness={"public": {"kind": "cifar10_c", "dir": str(pub), "use": "replace"},
                                        "corruptions": ["contrast"]})  # fmt: skip
    raw["data"]["name"] = FITS_BY_NAME
    with pytest.raises(StageError, match="robustness.public: ") as info:
        check_public_sets(Params.model_validate(raw), Path("/"))
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_published_set_that_fits_passes(tmp_path: Path, data: Path) -> None:
    import numpy as np

    from stages.published_check import check_public_sets

    pub = tmp_path / "pub"
    pub.mkdir()
    np.save(pub / "contrast.npy", np.zeros((10, 28, 28), np.uint8))  # one channel may drop its axis
    np.save(pub / "labels.npy", np.arange(10))
    raw = tiny_params(
        data, robustness={"public": {"kind": "cifar10_c", "dir": str(pub)}, "corruptions": ["contrast"]}
    )
    raw["data"]["name"] = FITS_BY_NAME
    check_public_sets(Params.model_validate(raw), Path("/"))


def test_validate_refuses_a_published_benchmark_of_other_images(data: Path) -> None:
    """Where the names say enough (core.data.catalog.DATASETS, core.robustness.public_kinds.PUBLIC_KINDS), a
    published benchmark of other images is refused when the params are read, before anything runs."""
    from core.config import ConfigError, validate_params

    for name, kind, says in (
        (
            "fashion_mnist",
            "cifar10_c",
            "cifar10_c holds 3-channel images, data.name fashion_mnist 1-channel ones",
        ),
        ("cifar100", "cifar10_c", "cifar10_c holds 10 classes, data.name cifar100 100"),
        ("cifar10", "tiny_imagenet_c", "tiny_imagenet_c holds 200 classes, data.name cifar10 10"),
    ):
        raw = tiny_params(data, robustness={"public": {"kind": kind, "dir": str(data)}})
        raw["data"]["name"] = name
        with pytest.raises(ConfigError, match="robustness.public.kind: ") as info:
            validate_params(raw)
        assert says in str(info.value)
    raw["data"]["name"], raw["robustness"]["public"]["kind"] = (
        "imagefolder",
        "imagenet_c",
    )  # its images: unknown
    raw["data"]["source"] = str(data)
    validate_params(raw)


def test_a_foreign_pretrained_cnn_is_refused_where_it_is_read(tmp_path: Path, data: Path) -> None:
    """A cnn-final.pt of another arch in this run's place is not scored as its CNN (evaluate, before any run
    opens), nor converted (reparam's t1 checkpoint goes through the same check); this run's own passes."""
    from core.training.checkpoint import atomic_save
    from stages import evaluate, robustness_bench
    from stages.harness import pretraining
    from stages.harness import training as T

    params = Params.model_validate(tiny_params(data, robustness={"baseline": "cnn"}))
    for path in robustness_bench.model_paths(params, tmp_path).values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    cnn = robustness_bench.model_paths(params, tmp_path)["cnn"]
    other = params.with_overrides({"model.arch": "resnet18"})
    atomic_save({"model": {}, "model_spec": pretraining.model_spec(other, 10, 1)}, cnn)
    with pytest.raises(StageError) as info:
        evaluate.check(params.with_overrides({"robustness.public": None}), tmp_path)
    assert str(info.value).startswith(
        f"{cnn}: holds a cnn/resnet18 network, the params pretrain cnn/resnet10_cifar"
    )
    T.check_cnn_checkpoint(
        {"model_spec": pretraining.model_spec(params, 10, 1)}, T.CnnWanted.of(params), cnn
    )  # its own: no error
    with pytest.raises(StageError, match="differs in options"):
        opts = params.with_overrides({"model.options": {"drop_rate": 0.1}})
        T.check_cnn_checkpoint(
            {"model_spec": pretraining.model_spec(opts, 10, 1)}, T.CnnWanted.of(params), cnn
        )


def test_a_published_set_that_does_not_fit_is_refused_by_validate(
    tmp_path: Path, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The params name the set and its headers are cheap to read: `tcnn validate` (the data prepared) refuses
    a resized set in one line, before any training; the set fixed, it passes."""
    import numpy as np

    from pipelines.cli import main as tcnn

    pub = tmp_path / "pub"
    pub.mkdir()
    np.save(pub / "contrast.npy", np.zeros((10, 32, 32, 3), np.uint8))  # CIFAR-sized, the data is 28 x 28 x 1
    np.save(pub / "labels.npy", np.arange(10))
    raw = tiny_params(data, robustness={"public": {"kind": "cifar10_c", "dir": str(pub), "use": "add"},
                                        "corruptions": ["contrast"]})  # fmt: skip
    raw["data"]["name"] = FITS_BY_NAME
    path = write_params(tmp_path / "params.yaml", raw)
    assert tcnn(["validate", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("tcnn validate: error: robustness.public: ") and "[N, 28, 28, 1]" in line, line
    assert "contrast.npy: uint8 [10, 32, 32, 3]" in line
    np.save(pub / "contrast.npy", np.zeros((10, 28, 28, 1), np.uint8))
    assert tcnn(["validate", str(path)]) == 0
