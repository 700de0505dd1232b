"""One identity per stage (stages/harness/identity.py): the DVC path's resume hash, the sweep's shared directories and
the corrupted-set cache all come from the stage's own identity function, so they cannot drift apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml
from test_sweep import make_project

from core.data import read_manifest
from core.robustness import corruptions as C
from pipelines.sweep.plan import make_plan
from pipelines.sweep.sweep_params import load_sweep_params
from stages import control, corrupt, finetune, pretrain
from stages.harness import pretraining
from stages.harness import training as T
from stages.harness.identity import code_digest, key


def test_the_sweep_names_shared_work_by_the_stages_own_identities(tmp_path: Path) -> None:
    """The shared pretraining, control and corrupted-set keys of a planned sweep are the keys of the identities
    the stages compute from the prepared data as the DVC path loads it (not a second description)."""
    path = make_project(tmp_path, {"reparam.alpha_init": [0.5, 2.0], "finetune.lr": [0.004, 0.01]})
    plan = make_plan(load_sweep_params(path), cwd=tmp_path)
    for t in plan.trials:
        p = t.params
        ds = T.datasets(p)
        spec = pretraining.model_spec(p, ds.num_classes, ds.in_chans)
        assert t.pretrain_key == key(pretrain.identity(p, spec, ds.fingerprint, "cpu", workers=1))
        inputs = {"pretrain": t.pretrain_key, "t1": p.reparam.epoch}
        expect = finetune.identity(p, inputs, "cpu", variant=control.VARIANT.name, workers=1)
        assert t.control_key == key(expect)
        assert t.corrupt_key == key(corrupt.identity(p, read_manifest(p.data.dir)))
    # alpha does not reach pretraining or the control; the fine-tuning lr reaches the control only.
    assert len(plan.groups) == 1 and len({t.corrupt_key for t in plan.trials}) == 1
    by_lr = {t.params.finetune.lr: t.control_key for t in plan.trials}
    assert len(plan.controls) == 2 and len(set(by_lr.values())) == 2


def test_corrupted_sets_carry_the_stage_identity_and_ignore_the_requested_list(tmp_path: Path) -> None:
    path = make_project(tmp_path, {})
    params = load_sweep_params(path)
    manifest = read_manifest(tmp_path / "data")
    ident = key(corrupt.identity(params, manifest))
    fewer = params.with_overrides({"robustness.corruptions": ["contrast"]})
    assert key(corrupt.identity(fewer, manifest)) == ident  # each set names its own corruption
    for change in ({"seed": 1}, {"robustness.n_images": 40}):
        assert key(corrupt.identity(params.with_overrides(change), manifest)) != ident, change
    corrupt.run(params, root=tmp_path)
    sets = [C.set_path(tmp_path / "data-c", c, 1) for c in params.robustness.corruptions]
    assert [C.read_set_meta(s)["identity"] for s in sets] == [ident, ident]
    index = json.loads((tmp_path / "data-c" / corrupt.INDEX).read_text())
    assert index["identity"] == ident
    # Under another identity (another seed) the stored sets are not valid: the stage regenerates them.
    other = key(corrupt.identity(params.with_overrides({"seed": 1}), manifest))
    meta = {**C.read_set_meta(sets[0]), "identity": other}
    assert C.set_is_valid(sets[0], {**meta, "identity": ident}) and not C.set_is_valid(sets[0], meta)


def test_the_code_part_is_the_stage_deps_dvc_yaml_lists(tmp_path: Path) -> None:
    """Editing a file a stage lists as a code dep changes its identity; editing any other file does not."""
    repo = tmp_path / "repo"
    (repo / "core").mkdir(parents=True)
    (repo / "stages").mkdir()
    for rel in ("core/used.py", "core/unused.py", "stages/a.py"):
        (repo / rel).write_text("x = 1\n")
    dvc = {"stages": {"a": {"cmd": "true", "deps": ["core/used.py", "stages/a.py", "data"]}}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump(dvc))
    before = code_digest("a", repo)
    (repo / "core/unused.py").write_text("x = 2\n")
    assert code_digest("a", repo) == before
    (repo / "core/used.py").write_text("x = 2\n")
    assert code_digest("a", repo) != before
    shutil.rmtree(repo)


def test_the_resume_hash_adds_the_kept_epochs_to_the_identity(tmp_path: Path) -> None:
    params = load_sweep_params(make_project(tmp_path, {}))
    spec = {"arch": "toy"}
    more = params.with_overrides({"pretrain.checkpoint_epochs": [0]})
    assert pretrain.identity(params, spec, "f", "cpu") == pretrain.identity(more, spec, "f", "cpu")
    assert pretrain.run_hash(params, spec, "f", "cpu") != pretrain.run_hash(more, spec, "f", "cpu")
    assert pretrain.run_hash(params, spec, "f", "cpu") != pretrain.run_hash(params, spec, "g", "cpu")


def test_the_smoke_size_is_part_of_every_identity_that_reads_a_capped_split(tmp_path: Path) -> None:
    """data.limit (the smoke size) names other pretraining, fine-tuning, control and corrupted-set results than
    the whole splits do; unset, the identities are those of a params file without the key (runs made before it
    existed keep their names); a test cap at or above robustness.n_images leaves the corrupted sets as they are
    (the capped split's first images are the whole split's)."""
    path = make_project(tmp_path, {})
    params = load_sweep_params(path)
    manifest = read_manifest(tmp_path / "data")
    ds = T.datasets(params, tmp_path)
    spec = pretraining.model_spec(params, ds.num_classes, ds.in_chans)

    def keys(p) -> tuple[str, str, str]:
        inputs = {"pretrain": "k", "t1": p.reparam.epoch}
        return (key(pretrain.identity(p, spec, ds.fingerprint, "cpu", workers=1)),
                key(finetune.identity(p, inputs, "cpu", variant=control.VARIANT.name, workers=1)),
                key(corrupt.identity(p, manifest)))  # fmt: skip

    raw = yaml.safe_load(path.read_text())
    assert "limit" not in raw["data"]  # the project's params file predates the key
    base = keys(params)
    assert keys(params.with_overrides({"data.limit": None})) == base
    for split in ("train", "val"):
        capped = keys(params.with_overrides({"data.limit": {split: 20}}))
        assert capped[0] != base[0] and capped[1] != base[1] and capped[2] == base[2], split
    # 50 corrupted images -> 30
    assert keys(params.with_overrides({"data.limit": {"test": 30}}))[2] != base[2]
    assert keys(params.with_overrides({"data.limit": {"test": 80}}))[2] == base[2]  # the same 50 images
    small = params.with_overrides({"data.limit": {"train": 20, "val": 10, "test": 30}})
    ds_small = T.datasets(small, tmp_path)
    assert (len(ds_small.train_y), len(ds_small.val_y), len(ds_small.test_y)) == (20, 10, 30)
    assert small.corrupted_images() == 30 and params.corrupted_images() == 50
