"""Issue 59's kinds of validation: a bound a library enforces is enforced at validation (seeds), every count has
an upper bound, numbers read as YAML 1.2 (and DVC) read them, ``model.code`` stays in the workspace, and every
params file the project ships provides every param dvc.yaml reads."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import annotated_types
import numpy as np
import pytest
import yaml
from _train_helpers import stage_env
from pydantic import BaseModel
from ruamel.yaml import YAML

from core.config import ConfigError, parse_override, read_yaml
from pipelines.sweep.sweep_params import SweepParams, load_sweep_params

REPO = Path(__file__).resolve().parents[1]
SEARCH = "sweep.search={space: {finetune.lr: {loguniform: [0.0001, 0.01]}}, seed: %d}"


def test_the_search_seed_is_bounded_where_numpy_bounds_it() -> None:
    """numpy's legacy seeding (what Optuna's samplers hand it) takes 0..2**32 - 1: so does validation."""
    top = 2**32 - 1
    np.random.RandomState(top)  # the library's own bound, the independent truth
    with pytest.raises(ValueError):
        np.random.RandomState(top + 1)
    assert load_sweep_params(REPO / "params.yaml", [SEARCH % top]).sweep.search.seed == top
    with pytest.raises(
        ConfigError, match=r"sweep\.search\.seed: Input should be less than or equal to 4294967295"
    ):
        load_sweep_params(REPO / "params.yaml", [SEARCH % (top + 1)])


def _int_fields(model: type[BaseModel], prefix: str = "") -> typing.Iterator[tuple[str, object]]:
    """(dotted key, field info) of every int field of the params model (``int`` or ``int | None``; lists of
    ints are bounded by their cross-checks), sections followed."""
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = typing.get_args(ann) if isinstance(ann, types.UnionType) or typing.get_origin(ann) else (ann,)
        for a in args:
            if isinstance(a, type) and issubclass(a, BaseModel):
                yield from _int_fields(a, f"{prefix}{name}.")
        if ann in (int, int | None):
            yield f"{prefix}{name}", info


def test_every_count_has_an_upper_bound() -> None:
    """Each int of the params (epochs, batch sizes, images, steps, trials, workers, seeds) has a maximum."""
    fields = dict(_int_fields(SweepParams))  # the science's sections and the sweep's
    assert {"pretrain.epochs", "sweep.search.num_samples", "robustness.n_images", "seed"} <= set(fields)
    unbounded = [k for k, info in fields.items()
                 if not any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in info.metadata)]  # fmt: skip
    assert unbounded == []


@pytest.mark.parametrize(
    "override,fragment",
    [
        (SEARCH.replace("seed: %d", "num_samples: 100000000000000000000"), "sweep.search.num_samples: Input should be less than or equal to 10000"),
        ("pretrain.epochs=1000000000", "pretrain.epochs: Input should be less than or equal to 100000"),
        ("robustness.n_images=1e12", "robustness.n_images: Input should be less than or equal to 100000000"),
        ("sweep.max_failures=99999999", "sweep.max_failures: Input should be less than or equal to 10000"),
        ("sweep.gpus_per_trial=1e9", "sweep.gpus_per_trial: Input should be less than or equal to 4096"),
    ],
)  # fmt: skip
def test_a_count_beyond_its_bound_is_one_line(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_sweep_params(REPO / "params.yaml", [override])


def test_a_grid_of_too_many_trials_is_refused() -> None:
    grid = [
        f"sweep.grid.seed=[{', '.join(map(str, range(101)))}]",
        "sweep.grid.finetune.lr=" + str([1e-4] * 100),
    ]
    with pytest.raises(ConfigError, match=r"sweep\.grid: 10100 trials \(the product"):
        load_sweep_params(REPO / "params.yaml", grid)


NUMBERS = [
    "1e-4",
    "1E5",
    "-2.5e-3",
    "+1e2",
    "3",
    "0.5",
    ".5",
    "1.",
    "-7",
    "1e-4x",
    "v1e3",
    "1_000",
    "0x10",
    ".inf",
]


def test_numbers_read_as_yaml_1_2_and_dvc_read_them() -> None:
    """A params value and a -S value read as ruamel's YAML 1.2 reader (DVC's) reads them wherever that reader
    gives a number or a string; PyYAML's YAML 1.1 extras (1_000, 0x10, .inf) keep their 1.1 meaning."""
    ruamel = YAML(typ="safe", pure=True)
    for text in NUMBERS:
        ours, theirs = read_yaml(f"v: {text}")["v"], ruamel.load(f"v: {text}")["v"]
        if text in ("1_000", "0x10", ".inf"):
            assert ours == yaml.safe_load(f"v: {text}")["v"]
        else:
            assert (type(ours), ours) == (type(theirs), theirs), text
    assert parse_override("x={a: [1e-4, 1e-2]}")[1] == {"a": [1e-4, 1e-2]}


def test_a_search_in_flow_style_with_exponents_is_accepted(tmp_path: Path) -> None:
    override = "sweep.search={space: {finetune.lr: {loguniform: [1e-4, 1e-2]}}}"
    params = load_sweep_params(REPO / "params.yaml", [override])
    assert params.sweep.search.space == {"finetune.lr": {"loguniform": [1e-4, 1e-2]}}
    text = (REPO / "params.yaml").read_text().replace("  lr: 0.0001", "  lr: 1e-4")
    assert "lr: 1e-4" in text
    (tmp_path / "p.yaml").write_text(text)
    assert load_sweep_params(tmp_path / "p.yaml").finetune.lr == 1e-4


def _workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    ws = tmp_path / "ws"
    (ws / "nets").mkdir(parents=True)
    (ws / "nets" / "mine.py").write_text("")
    # a DVC workspace whose stages depend on the network's code, as the project's dvc.yaml does
    (ws / "dvc.yaml").write_text("stages:\n  build:\n    cmd: python -c pass\n    deps: [${model.code}]\n")
    (ws / "params.yaml").write_text((REPO / "params.yaml").read_text())
    (tmp_path / "outside").mkdir()
    (ws / "escape").symlink_to(tmp_path / "outside")
    monkeypatch.chdir(ws)
    return ws


@pytest.mark.parametrize(
    "code,fragment",
    [
        ("/etc/hostname", "model.code: /etc/hostname is not inside the workspace"),
        ("../outside", "model.code: ../outside is not inside the workspace"),
        ("nets/../../outside", "model.code: nets/../../outside is not inside the workspace"),
        ("nets/nope.py", "model.code: nets/nope.py does not exist in the workspace"),
        ("escape", "model.code: escape leads outside the workspace"),
    ],
)
def test_model_code_is_a_workspace_path_that_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, fragment: str
) -> None:
    _workspace(tmp_path, monkeypatch)
    assert load_sweep_params("params.yaml", ["model.code=nets/mine.py"]).model.code == Path("nets/mine.py")
    assert load_sweep_params("params.yaml", ["model.code=nets"]).model.code == Path("nets")
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        load_sweep_params("params.yaml", [f"model.code={code}"])


def test_tcnn_validate_refuses_model_code_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = _workspace(tmp_path, monkeypatch)
    p = subprocess.run([sys.executable, "-m", "pipelines.cli", "validate", "-S", "model.code=missing"], cwd=ws,
                       env=stage_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (
        p.returncode == 2 and p.stderr.count("\n") == 1 and "model.code: missing does not exist" in p.stderr
    )


# ------------------------------------------------------------------------------- the params files shipped


def dvc_params() -> set[str]:
    """Every param dvc.yaml reads from params.yaml: its stages' ``params:`` lists and its ``${...}`` values."""
    text = (REPO / "dvc.yaml").read_text()
    keys = set(re.findall(r"\$\{([\w.]+)\}", text))
    for stage in yaml.safe_load(text)["stages"].values():
        for entry in stage.get("params", []):
            if isinstance(entry, str):
                keys.add(entry)
            else:  # {file: [keys]}; `params.yaml:` with no list reads the whole file
                keys.update(k for ks in entry.values() for k in ks or [])
    return keys


def shipped_params_files() -> list[Path]:
    """params.yaml, the presets, the studies, and every params file the docs copy into params.yaml."""
    files = [REPO / "params.yaml", *sorted((REPO / "pipelines").glob("presets/*.yaml")),
             *sorted((REPO / "pipelines").glob("studies/*.yaml"))]  # fmt: skip
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for rel in re.findall(r"cp (\S+\.ya?ml) params\.yaml", doc.read_text()):
            files.append(REPO / rel)
    return list(dict.fromkeys(files))


@pytest.mark.parametrize("path", shipped_params_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_a_shipped_params_file_validates_and_has_every_param_dvc_reads(path: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(path.read_text()) or {}

    def has(key: str) -> bool:
        node = raw
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    keys = dvc_params()
    assert {"data.limit", "data.val_from", "model.code", "seed"} <= keys
    assert sorted(k for k in keys if not has(k)) == []
    sets = []
    if ((raw.get("pretrain") or {}).get("source") or {}).get("weights") not in (None, "timm"):
        stand_in = tmp_path / "w.th"  # the weights are the user's download: only their readability is checked
        stand_in.write_bytes(b"stand-in")
        sets.append(f"pretrain.source.weights={stand_in}")
    load_sweep_params(path, sets)
