"""The params model: the default validates; bad configurations fail with one line naming the key, exit 2,
and nothing written."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _train_helpers import repo_pythonpath

from core.config import ConfigError, Params
from pipelines.cli import main as tcnn_main
from pipelines.sweep.sweep_params import SweepParams, load_sweep_params

REPO = Path(__file__).resolve().parents[1]
DEFAULT = yaml.safe_load((REPO / "params.yaml").read_text())


def merged(change: dict[str, Any]) -> dict[str, Any]:
    """The default params.yaml with `change` merged in (a nested dict; None values are set, not removed)."""
    raw = copy.deepcopy(DEFAULT)

    def merge(node: dict, upd: dict) -> None:
        for k, v in upd.items():
            if isinstance(v, dict) and isinstance(node.get(k), dict) and v:
                merge(node[k], v)
            else:
                node[k] = v

    merge(raw, change)
    return raw


def write(tmp_path: Path, raw: Any, name: str = "bad.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return path


def test_default_params_validate() -> None:
    params = load_sweep_params(REPO / "params.yaml")
    assert isinstance(params, Params)
    assert params.data.name == "fashion_mnist" and 0 < params.data.sample_fraction <= 1
    assert params.reparam.epoch <= params.pretrain.epochs


def test_tcnn_validate_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert tcnn_main(["validate", str(REPO / "params.yaml")]) == 0
    assert ": ok (" in capsys.readouterr().out


# (change to the default params, expected fragment of the error line)
BAD: list[tuple[dict[str, Any], str]] = [
    ({"foo": 1}, "foo: unknown key"),
    ({"data": {"nam": "x"}}, "data.nam: unknown key"),
    ({"pretrain": {"augment": {"flip": True}}}, "pretrain.augment.flip: unknown key"),
    ({"data": {"name": "mnist"}}, "data.name: Input should be 'fashion_mnist', 'cifar10', 'cifar100' or 'imagefolder'"),
    ({"data": {"sample_fraction": 0.0}}, "data.sample_fraction: Input should be greater than 0"),
    ({"data": {"sample_fraction": 1.5}}, "data.sample_fraction: Input should be less than or equal to 1"),
    ({"data": {"sample_fraction": -0.2}}, "data.sample_fraction: Input should be greater than 0"),
    ({"data": {"sample_fraction": "half"}}, "data.sample_fraction: Input should be a valid number"),
    ({"pretrain": {"epochs": 0}}, "pretrain.epochs: Input should be greater than 0"),
    ({"pretrain": {"epochs": -3}}, "pretrain.epochs: Input should be greater than 0"),
    ({"pretrain": {"epochs": 2.5}}, "pretrain.epochs: Input should be a valid integer"),
    ({"finetune": {"epochs": 0}}, "finetune.epochs: Input should be greater than 0"),
    ({"finetune": {"stop": {"patience": 0}}}, "finetune.stop.patience: Input should be greater than or equal to 1"),
    ({"finetune": {"stop": {"min_delta_images": -1}}}, "finetune.stop.min_delta_images: Input should be greater than or equal to 0"),
    ({"finetune": {"stop": {"min_delta_images": 0.5}}}, "finetune.stop.min_delta_images: Input should be a valid integer"),
    ({"finetune": {"stop": {"patiense": 3}}}, "finetune.stop.patiense: unknown key"),
    ({"reparam": {"alpha_init": 0.0}}, "reparam.alpha_init: Input should be greater than 0"),
    ({"reparam": {"alpha_init": -1.0}}, "reparam.alpha_init: Input should be greater than 0"),
    ({"pretrain": {"epochs": 6}, "reparam": {"epoch": 7}}, "reparam.epoch: t1=7 exceeds pretrain.epochs=6"),
    ({"pretrain": {"epochs": 1}}, "reparam.epoch: t1=2 exceeds pretrain.epochs=1"),
    ({"model": {"arch": "resnet_nope"}}, "model.arch: unknown arch 'resnet_nope'"),
    ({"model": {"kind": "vit"}}, "model.kind: Input should be"),
    ({"finetune": {"mode": "restart"}}, "finetune.mode: Input should be 'fresh' or 'continue'"),
    ({"reparam": {"stride_mode": "s2"}}, "reparam.stride_mode: Input should be 'exact' or 's1'"),
    ({"data": {"source": "/nonexistent/fmnist"}}, "data.source: path '/nonexistent/fmnist' does not exist"),
    ({"data": {"image_size": 4}}, "data.image_size: Input should be greater than or equal to 8"),
    ({"data": {"val_size": -1}}, "data.val_size: Input should be greater than or equal to 0"),
    ({"data": {"shard_rows": 0}}, "data.shard_rows: Input should be greater than or equal to 16"),
    ({"data": {"num_workers": -1}}, "data.num_workers: Input should be greater than or equal to 0"),
    ({"pretrain": {"batch_size": 0}}, "pretrain.batch_size: Input should be greater than 0"),
    ({"pretrain": {"lr": "fast"}}, "pretrain.lr: Input should be a valid number"),
    ({"pretrain": {"augment": {"label_smoothing": 1.0}}}, "pretrain.augment.label_smoothing: Input should be less than 1"),
    ({"finetune": {"image_size": 2048}}, "finetune.image_size: Input should be less than or equal to 1024"),
    ({"model": {"drop_path": 1.0}}, "model.drop_path: Input should be less than 1"),
    ({"robustness": {"severities": [0, 3]}}, "robustness.severities: severities must be a non-empty subset of 1..5"),
    ({"robustness": {"corruptions": ["gaussian_noise", "rain"]}}, "robustness.corruptions: unknown corruption(s) ['rain']"),
    ({"robustness": {"corruptions": []}}, "robustness.corruptions: must name at least one corruption"),
    ({"tracking": {"experiment": ""}}, "tracking.experiment: String should have at least 1 character"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"data": None}, "data: Input should be a valid dictionary"),
    ({"sweep": {"grid": {"data.sample_fraction": [0.5, 2.0]}}}, "sweep.grid.data.sample_fraction: value 2.0 is invalid"),
    ({"sweep": {"grid": {"reparam.alpha_init": [1.0, 0.0]}}}, "sweep.grid.reparam.alpha_init: value 0.0 is invalid"),
    ({"sweep": {"grid": {"reparam.epoch": [2, 9]}}}, "sweep.grid.reparam.epoch: value 9 is invalid (reparam.epoch: t1=9"),
    ({"sweep": {"grid": {"data.nope": [1]}}}, "sweep.grid.data.nope: data.nope: unknown key"),
    ({"sweep": {"grid": {"seed": 3}}}, "sweep.grid.seed: Input should be a valid list"),
    ({"data": {"limit": {"test": 0}}}, "data.limit.test: Input should be greater than 0"),
    ({"data": {"limit": {"train": 2.5}}}, "data.limit.train: Input should be a valid integer"),
    ({"data": {"limit": {"tests": 100}}}, "data.limit.tests: unknown key"),
    ({"data": {"val_from": "test"}}, "data.val_from: Input should be 'train' or 'test_half'"),
    ({"data": {"val_from": "test_half"}}, "data.val_size: 5000 carves validation from the training split, data.val_from: test_half takes it from the test split; set data.val_size: 0"),
]  # fmt: skip


def test_there_are_at_least_20_bad_configurations() -> None:
    assert (
        len(BAD) >= 20 and len({frag for _, frag in BAD}) == len(BAD) - 3
    )  # three messages repeat on purpose


@pytest.mark.parametrize("change,fragment", BAD, ids=[f for _, f in BAD])
def test_bad_configuration(tmp_path: Path, change: dict[str, Any], fragment: str) -> None:
    path = write(tmp_path, merged(change))
    with pytest.raises(ConfigError) as info:
        load_sweep_params(path)
    msg = str(info.value)
    assert fragment in msg
    assert msg.startswith(f"{path}: ") and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]  # nothing written


LR_GRID = {"grid": {"finetune.lr": [0.0001, 0.001, 0.01]}, "select": {"over": ["finetune.lr"]}}


@pytest.mark.parametrize(
    "bracket,grid,fragment",
    [
        ({"max_rounds": 0}, None, "sweep.select.bracket.max_rounds: Input should be greater than or equal to 1"),
        ({"max_rounds": 11}, None, "sweep.select.bracket.max_rounds: Input should be less than or equal to 10"),
        ({"rounds": 2}, None, "sweep.select.bracket.rounds: unknown key"),
        ({"key": "seed"}, None, "sweep.select.bracket.key: 'seed' is not in sweep.select.over (['finetune.lr'])"),
        (True, [0.0001, 0.001, 0.003], "sweep.select.bracket: sweep.grid.finetune.lr must hold at least two "
         "positive numbers with a constant ratio (a log-spaced grid, e.g. [0.0001, 0.001, 0.01]), got"),
        (True, [0.001], "sweep.grid.finetune.lr must hold at least two positive numbers"),
    ],
)  # fmt: skip
def test_bad_bracket(tmp_path: Path, bracket: Any, grid: list | None, fragment: str) -> None:
    """``sweep.select.bracket``: one line naming the key, nothing written."""
    sweep = copy.deepcopy(LR_GRID)
    sweep["select"]["bracket"] = bracket
    if grid is not None:
        sweep["grid"]["finetune.lr"] = grid
    path = write(tmp_path, merged({"sweep": sweep}))
    with pytest.raises(ConfigError) as info:
        load_sweep_params(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_bracket_settings() -> None:
    """``bracket: true`` takes the defaults and the one key of over; no bracket on an empty over is refused."""
    from pipelines.sweep.settings import bracket_key, log_step

    p = load_sweep_params(REPO / "params.yaml", [f"sweep.grid.finetune.lr={LR_GRID['grid']['finetune.lr']}",
                                           "sweep.select.over=[finetune.lr]", "sweep.select.bracket=true"])  # fmt: skip
    assert p.sweep.select.bracket.max_rounds == 3 and bracket_key(p.sweep.select) == "finetune.lr"
    assert (
        load_sweep_params(REPO / "params.yaml", ["sweep.select.bracket=false"]).sweep.select.bracket is None
    )
    with pytest.raises(ConfigError, match="sweep.select.bracket.key: name the key to extend"):
        load_sweep_params(REPO / "params.yaml", ["sweep.select.bracket=true"])
    assert log_step([0.01, 0.0001, 0.001]) == 10.0 and log_step([1, 2, 4]) == 2.0
    assert log_step([1, 2, 3]) is None and log_step([0.0, 1.0]) is None and log_step([True, 2]) is None


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("- 1\n- 2\n", "expected a mapping at the top level, got list"),
        ("data: {name: fashion_mnist\n", "not valid YAML at line 1: expected"),
        ("seed: 0\ndata:\n  name: [unclosed\n", "not valid YAML at line 3"),
    ],
)
def test_malformed_files(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=rf".*{fragment.replace('(', '[(]')}"):
        load_sweep_params(write(tmp_path, text))


def test_missing_params_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml: no such params file"):
        load_sweep_params(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("data.foo=1", "data.foo: unknown key"),
        ("data.name", "override 'data.name': expected key=value"),
        ("reparam.epoch=9", "reparam.epoch: t1=9 exceeds pretrain.epochs=2"),
        ("data.sample_fraction=0", "data.sample_fraction: Input should be greater than 0"),
        ("finetune.mode=frozen", "finetune.mode: Input should be 'fresh' or 'continue'"),
    ],
)
def test_bad_overrides(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=".*" + fragment.replace("(", "[(]")):
        load_sweep_params(REPO / "params.yaml", [override])


def test_good_overrides_are_typed() -> None:
    p = load_sweep_params(
        REPO / "params.yaml", ["data.sample_fraction=0.1", "reparam.alpha_init=2", "seed=3"]
    )
    assert p.data.sample_fraction == 0.1 and p.reparam.alpha_init == 2.0 and p.seed == 3
    assert p.with_overrides({"reparam.lambda_init": 5}).reparam.lambda_init == 5.0
    with pytest.raises(ConfigError, match="reparam.alpha_init: Input should be greater than 0"):
        p.with_overrides({"reparam.alpha_init": -1})


@pytest.mark.parametrize("change,fragment", [BAD[4], BAD[14], BAD[16], BAD[18], BAD[20]])
def test_cli_exit_status_2_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change, fragment
) -> None:
    path = write(tmp_path, merged(change))
    assert tcnn_main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tcnn validate: error: ") and fragment in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_stage_cli_in_process_rejects_bad_params(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from stages.prepare import main as prepare_main

    raw = merged({"data": {"dir": str(tmp_path / "out"), "sample_fraction": 2.0}})
    assert prepare_main(["--params", str(write(tmp_path, raw))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepare: error: ") and "data.sample_fraction" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_real_processes_exit_2_and_write_nothing(tmp_path: Path) -> None:
    """`tcnn validate` and `python -m stages.prepare` as a user runs them (a fresh interpreter each)."""
    raw = merged({"data": {"dir": "out"}, "reparam": {"alpha_init": -1.0}})
    write(tmp_path, raw)
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    tcnn = Path(sys.executable).with_name("tcnn")
    for cmd in (
        [str(tcnn), "validate", "bad.yaml"],
        [sys.executable, "-m", "stages.prepare", "--params", "bad.yaml"],
    ):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "reparam.alpha_init: Input should be greater than 0" in proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stdout == ""
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


# Gaps found in the first version of core/config.py (now fixed): keep them rejected.


@pytest.mark.parametrize(
    "change,fragment",
    [
        ({"pretrain": {"epochs": True}, "reparam": {"epoch": 1}}, "pretrain.epochs"),  # a bool is not 1 epoch
        ({"data": {"sample_fraction": True}}, "data.sample_fraction"),  # now: 1.0
        (
            {"pretrain": {"augment": {"randaugment": "bogus"}}},
            "pretrain.augment.randaugment",
        ),  # now: fails in training
        ({"data": {"name": "imagefolder", "source": None}}, "data.source"),  # an ImageFolder needs its tree
        ({"pretrain": {"checkpoint_epochs": [99]}}, "pretrain.checkpoint_epochs"),  # beyond pretrain.epochs
    ],
)
def test_rejected_edge_cases(tmp_path: Path, change: dict[str, Any], fragment: str) -> None:
    try:
        load_sweep_params(write(tmp_path, merged(change)))
    except ConfigError as err:
        assert fragment in str(err)
        return
    raise AssertionError("accepted")


def test_sweep_grid_override_with_dotted_key() -> None:
    """DESIGN section 4: `sweep.grid.<dotted param>`; `-S` must reach any param, grid entries included."""
    try:
        p = load_sweep_params(REPO / "params.yaml", ["sweep.grid.data.sample_fraction=[0.1, 0.5]"])
    except ConfigError as err:
        raise AssertionError(str(err)) from None
    assert p.sweep.grid == {"data.sample_fraction": [0.1, 0.5]}


def test_config_defaults_equal_params_yaml() -> None:
    """One default per key: the pydantic model's defaults are the default experiment of params.yaml."""
    assert SweepParams().model_dump(mode="json") == load_sweep_params(REPO / "params.yaml").model_dump(
        mode="json"
    )


def test_one_augmentation_policy_unless_a_phase_sets_its_own() -> None:
    p = load_sweep_params(REPO / "params.yaml")
    assert p.augment_for("pretrain") == p.augment_for("finetune") == p.augment
    own = p.with_overrides({"finetune.augment.crop_padding": 0})
    assert own.augment_for("finetune").crop_padding == 0 and own.augment_for("pretrain") == p.augment


def test_learning_rates_scale_with_the_batch() -> None:
    """[TCNN21] Sec. 3 gives lr 1e-4 and the gates' 0.1 at batch 1024: both scale linearly, keeping their ratio."""
    p = load_sweep_params(REPO / "params.yaml").with_overrides({"finetune.batch_size": 256})
    lr, gate = p.finetune.scaled_lrs()
    assert lr == pytest.approx(p.finetune.lr / 4) and gate == pytest.approx(p.finetune.gate_lr / 4)


@pytest.mark.parametrize(
    "extra,fragment",
    [
        ({"finetune": {"control_lr": 0.001}},
         "sweep.select.over: finetune.lr is chosen per arm, which finetune.control_lr fixes for the control"),
        # the grid form of the same conflict is refused alike
        ({"sweep": {"grid": {**LR_GRID["grid"], "finetune.control_lr": [0.001, 0.01]}}},
         "sweep.select.over: finetune.lr is chosen per arm, which finetune.control_lr fixes for the control"),
        ({"sweep": {"select": {"over": ["pretrain.seed"]}, "grid": {"pretrain.seed": [0, 1]}}},
         "sweep.select.over: 'pretrain.seed' is not a grid key other than seed and pretrain.seed"),
        ({"pretrain": {"seed": -1}}, "pretrain.seed: Input should be greater than or equal to 0"),
    ],
)  # fmt: skip
def test_study_design_keys_are_checked(tmp_path: Path, extra: dict, fragment: str) -> None:
    """``finetune.control_lr`` and ``pretrain.seed`` (the CNN as the unit): one line, nothing written."""
    raw = merged({"sweep": copy.deepcopy(LR_GRID)})
    for section, values in extra.items():
        raw.setdefault(section, {}).update(values)
    path = write(tmp_path, raw)
    with pytest.raises(ConfigError) as info:
        load_sweep_params(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "override,fragment",
    [
        ("reparam.alpha_init=.nan", "reparam.alpha_init: Input should be a finite number, got nan"),
        ("reparam.lambda_init=.inf", "reparam.lambda_init: Input should be a finite number, got inf"),
        ("finetune.lr=.inf", "finetune.lr: Input should be a finite number"),
        ("pretrain.warmup_epochs=-.inf", "pretrain.warmup_epochs: Input should be a finite number"),
        ("sweep.grid={finetune.lr: [0.001, .nan]}", "sweep.grid.finetune.lr: value nan is invalid"),
        (f"seed={2**64}", "seed: Input should be less than or equal to 9223372036854775807"),
        ("finetune.lr={", "override 'finetune.lr={': the value is not valid YAML"),
        ("sweep.grid=[0.1,", "override 'sweep.grid=[0.1,': the value is not valid YAML"),
        (
            "robustness.baseline=alexnet",
            "robustness.baseline: alexnet holds ImageNet-C's errors, which normalise "
            "ImageNet-sized images only; this run tests at 28 px (the cifar band)",
        ),
        ("robustness.dir=data/fashion_mnist", "robustness.dir: data/fashion_mnist overlaps data.dir"),
        ("robustness.dir=data/fashion_mnist/c", "robustness.dir: data/fashion_mnist/c overlaps data.dir"),
    ],
)
def test_values_validation_let_through_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, fragment: str
) -> None:
    """NaN passed every gt=0 check (a NaN T-CNN, exit 0); a seed beyond 64 bits overflowed numpy; an
    unclosed `{` in -S was a yaml traceback; alexnet normalised a 28 px run by ImageNet-C's errors; corrupted
    sets inside data.dir changed prepare's DVC output. Each is now one line, exit 2, nothing written."""
    with pytest.raises(ConfigError) as info:
        load_sweep_params(REPO / "params.yaml", [override])
    assert fragment in str(info.value) and "\n" not in str(info.value)
    path = write(tmp_path, merged({}), "params.yaml")
    assert tcnn_main(["validate", str(path), "-S", override]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("pretrain: {epochs: 1, epochs: 7}\n", "not valid YAML at line 1: key 'epochs' given twice"),
        ("seed: 0\ndata:\n  name: [fashion_mnist\n", "not valid YAML at line 3: expected ',' or ']'"),
        ("seed: 0\npretrain:\n  epochs: 2\n  epochs: 3\n", "key 'epochs' given twice (lines 3 and 4)"),
    ],
)
def test_bad_params_files_give_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr


def test_validate_a_directory_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"tcnn validate: error: {tmp_path}: is a directory, not a params file"


def _loaded_in_fresh_interpreter(probe: str, heavy: tuple[str, ...]) -> list[str]:
    """Which of the ``heavy`` modules a fresh interpreter holds after running ``probe`` (the repository on its
    path); the probe failing fails the test."""
    code = f"{probe}\nimport json, sys\nprint(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))"
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_command_line_loads_no_science_until_a_command_runs() -> None:
    """`tcnn --help`, and a refusal of a missing params file, answer from the parser and the configuration
    alone: building the whole parser (every subcommand) in a fresh interpreter loads neither torch, timm, Ray
    nor MLflow (each `tcnn` process paid torch's import, about 2 s, before it could say anything)."""
    probe = "from pipelines.cli import build_parser\nbuild_parser().format_help()"
    assert _loaded_in_fresh_interpreter(probe, ("torch", "timm", "ray", "mlflow", "scipy")) == []
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    res = subprocess.run([sys.executable, "-m", "pipelines.cli", "sweep", "--params", "missing.yaml"],
                         capture_output=True, text=True, env=env)  # fmt: skip
    assert res.returncode == 2 and "missing.yaml" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_the_name_registries_load_no_science() -> None:
    """The configuration checks every registry's names (datasets, kinds, stride modes, corruptions,
    published benchmarks, precisions) from modules that load neither torch, numpy, PIL nor timm, in a fresh
    interpreter; and the names are the ones the science modules use."""
    probe = (
        "from core.config import allowed, rules\n"
        "names = {r: allowed(r) for r in rules.name_questions()}\n"
        "assert len(names) == 6, names"
    )
    assert _loaded_in_fresh_interpreter(probe, ("torch", "numpy", "PIL", "timm", "scipy", "pyarrow")) == []
    import torch

    from core.config import allowed
    from core.data.importers import DATASETS
    from core.robustness.public_sets import PUBLIC_KINDS
    from core.training.precision import autocast

    assert allowed("datasets") == tuple(DATASETS) and allowed("public_sets") == tuple(PUBLIC_KINDS)
    with autocast(torch.device("cpu"), "bf16"):  # torch, loaded where a context is made, still autocasts
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_every_question_of_the_config_is_answered_by_the_science_once_core_is_imported() -> None:
    """core.config.rules: each question the config asks (a module-level name of rules.py) is answered by one
    science module's ``config_rules``; an unanswered one is a clear LookupError, not a silent pass."""
    from core.config import rules

    questions = {v for k, v in vars(rules).items() if k.isupper() and isinstance(v, str)}
    assert len(questions) == 15
    answered = set(rules.name_questions()) | set(rules._RULES)
    assert answered == questions
    assert rules.rule(rules.MODEL_KIND)("tcnn").name == "tcnn"
    with pytest.raises(LookupError, match="no science module answered 'nope'"):
        rules.names("nope")
