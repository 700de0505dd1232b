"""A user's builder (``model.arch: package.module:function``) is network code like the kinds': DVC sees it through
``model.code`` (dvc.yaml's ``${model.code}``, which the configuration makes hold a workspace builder), and the
pretraining checkpoint records its files' sha256 (or an installed builder's distribution and version), so a
stage that starts from the checkpoint refuses it once the builder changed (`stale_network_code`).

The truths are the files' own sha256 (hashlib) and the installed version (importlib.metadata); the DVC test
reads DVC's own resolution of dvc.yaml and `dvc status` in a throw-away copy of the project.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from core.config import ConfigError, validate_params
from stages import pretrain
from stages.harness import pretraining
from stages.harness.identity import stale_network_code

REPO = Path(__file__).resolve().parents[1]
#: A user's package in the workspace: the builder's module imports a block from a sibling module.
PACKAGE = {
    "__init__.py": '"""A user\'s networks."""\n',
    "blocks.py": (
        "import torch.nn as nn\n\n\n"
        "def block(c):\n"
        "    return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())\n"
    ),
    "small.py": (
        "import torch.nn as nn\n\n"
        "from wsnets.blocks import block\n\n\n"
        "def small(num_classes=10):\n"
        "    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), block(8), nn.AdaptiveAvgPool2d(1),\n"
        "                         nn.Flatten(), nn.Linear(8, num_classes))\n"
    ),
}
ARCH = "wsnets.small:small"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _params(arch: str, code: str | None = None):
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["model"]["arch"] = arch
    if code is not None:
        raw["model"]["code"] = code
    return validate_params(raw)


def write_package(folder: Path) -> Path:
    """The user's package ``wsnets`` written into the workspace ``folder``; returns its folder."""
    pkg = folder / "wsnets"
    pkg.mkdir(parents=True, exist_ok=True)
    for name, text in PACKAGE.items():
        (pkg / name).write_text(text)
    return pkg


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A workspace (the working directory) holding ``wsnets``, imported afresh and forgotten afterwards."""
    write_package(tmp_path)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in [m for m in sys.modules if m == "wsnets" or m.startswith("wsnets.")]:
        del sys.modules[name]
    while str(tmp_path) in sys.path:  # load_builder puts the workspace first, as `python -m` would
        sys.path.remove(str(tmp_path))


def test_a_workspace_builder_outside_model_code_is_refused_with_the_value_to_set(workspace: Path) -> None:
    with pytest.raises(ConfigError) as err:
        _params(ARCH)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("model.code: core/models/resnets.py does not hold wsnets/small.py")
    assert msg.endswith("set model.code: wsnets")
    with pytest.raises(ConfigError, match=r"^model.code: wsnets/small.py does not hold wsnets/"):
        _params(ARCH, "wsnets/small.py")  # the package's other modules run too
    with pytest.raises(ConfigError, match=r"^model.code: \. holds the whole workspace"):
        _params(ARCH, ".")
    assert _params(ARCH, "wsnets").model.code == Path("wsnets")


def test_the_checkpoint_records_a_workspace_builders_files_and_an_edit_is_stale(workspace: Path) -> None:
    """network_code (what pretrain writes into every checkpoint) holds the sha256 of each file the builder
    runs: its module, the sibling module it imports, its package's __init__ (outside the project's folder: by
    absolute path); editing one is stale, and the pretraining identity (a sweep's shared directory) changes."""
    params = _params(ARCH, "wsnets")
    pkg = (workspace / "wsnets").resolve()
    recorded = pretraining.network_code(params)
    assert recorded == {str(pkg / name): _sha(pkg / name) for name in sorted(PACKAGE)}
    assert stale_network_code(recorded) == []
    spec = pretraining.model_spec(params, 10, 1)
    before = pretrain.identity(params, spec, "data", "cpu")
    assert before["network_code"] == recorded
    (pkg / "blocks.py").write_text(PACKAGE["blocks.py"].replace("nn.ReLU()", "nn.GELU()"))
    assert stale_network_code(recorded) == [str(pkg / "blocks.py")]
    assert pretrain.identity(params, spec, "data", "cpu") != before


def test_a_project_builder_is_recorded_by_path_an_installed_one_by_version(tmp_path: Path) -> None:
    """The preset's builder (core/models/he_cifar.py, which dvc.yaml lists only through model.code) is
    recorded relative to the project; an edit of a copy is stale. torchvision's builders are installed from
    uv.lock: recorded as the distribution's version."""
    params = _params("core.models.he_cifar:resnet20", "core/models/he_cifar.py")
    recorded = pretraining.network_code(params)
    assert recorded == {"core/models/he_cifar.py": _sha(REPO / "core/models/he_cifar.py")}
    copy = tmp_path / "core/models/he_cifar.py"
    copy.parent.mkdir(parents=True)
    shutil.copy(REPO / "core/models/he_cifar.py", copy)
    assert stale_network_code(recorded, repo=tmp_path) == []
    copy.write_text(copy.read_text() + "\n# edited\n")
    assert stale_network_code(recorded, repo=tmp_path) == ["core/models/he_cifar.py"]

    installed = pretraining.network_code(_params("torchvision.models:resnet18"))
    assert installed == {"dist:torchvision": importlib.metadata.version("torchvision")}
    assert stale_network_code({"dist:torchvision": "0.0.1"}) == ["dist:torchvision"]
    assert pretraining.network_code(_params("resnet10_cifar_os16")) == {}  # dvc.yaml lists it all


def test_every_stage_that_builds_a_network_depends_on_model_code() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    building = {s for s, spec in stages.items() if (spec.get("meta") or {}).get("builds")}
    assert building == {s for s, spec in stages.items() if "${model.code}" in spec["deps"]}
    assert building >= {"pretrain", "reparam", "finetune", "control", "evaluate"}


@pytest.mark.slow
def test_editing_a_workspace_builder_makes_dvc_rerun_the_stages_that_build_the_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a throw-away copy of the project whose params name a workspace builder (model.code: wsnets), DVC
    resolves ``${model.code}`` to the package for every stage that builds the network; after `dvc commit` of
    pretrain (its outputs stand-ins: nothing runs), `dvc status pretrain` is clean, and editing the builder's
    sibling module makes it report the package changed."""
    from _pipeline_repo import dvc, make_repo

    repo = make_repo(tmp_path / "repo", {"model": {"arch": ARCH, "code": "wsnets"}})
    write_package(repo)
    (repo / "data/fashion_mnist").mkdir(parents=True)  # prepare's output, a dep of pretrain
    (repo / "data/fashion_mnist/manifest.json").write_text("{}")
    (repo / "runs/check").mkdir(parents=True)  # the check stage's output, a dep of pretrain
    (repo / "runs/check/passed.json").write_text("{}")
    for out in ("ckpt/ckpt-epoch-001.pt", "cnn-final.pt", "history.json", "history.csv", "metrics.json"):
        (repo / "runs/pretrain" / out).parent.mkdir(parents=True, exist_ok=True)
        (repo / "runs/pretrain" / out).write_text(out)

    from dvc.repo import Repo

    # DVC's site cache where `dvc` below keeps it: nothing is written outside the copy
    monkeypatch.setenv("DVC_SITE_CACHE_DIR", str(tmp_path / "repo-dvc-site"))
    with Repo(str(repo)) as r:
        deps = {s.name: {str(d.def_path) for d in s.deps} for s in r.index.stages}
    building = {s for s, spec in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].items()
                if (spec.get("meta") or {}).get("builds")}  # fmt: skip
    assert {s for s, d in deps.items() if "wsnets" in d} == building

    dvc(repo, "commit", "--force", "pretrain")
    assert json.loads(dvc(repo, "status", "pretrain", "--json").stdout or "{}") == {}
    (repo / "wsnets/blocks.py").write_text(PACKAGE["blocks.py"].replace("nn.ReLU()", "nn.GELU()"))
    status = json.loads(dvc(repo, "status", "pretrain", "--json").stdout or "{}")
    assert status == {"pretrain": [{"changed deps": {"wsnets": "modified"}}]}, status
