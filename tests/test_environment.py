"""The environment is the lock: uv.lock matches pyproject.toml, and the installed .venv is exactly what it pins
(uv's own check; it fails on any missing, extra or differently versioned package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _uv() -> str:
    """The uv scripts/setup.sh used: its own in .tools/, else the one on PATH."""
    uv = REPO / ".tools" / "bin" / "uv"
    found = str(uv) if uv.exists() else shutil.which("uv")
    if found is None:
        pytest.skip("no uv: run scripts/setup.sh")
    return found


def test_installed_environment_is_the_lock() -> None:
    if Path(sys.prefix).resolve() != (REPO / ".venv").resolve():
        pytest.skip("the suite runs outside the project's .venv")
    out = subprocess.run(
        [_uv(), "sync", "--locked", "--check", "--extra", "dev", "--offline"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_lock_pins_the_tested_torch_and_uv() -> None:
    lock = tomllib.loads((REPO / "uv.lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    for pin in PYPROJECT["tool"]["uv"]["constraint-dependencies"]:
        name, version = pin.split("==")
        assert versions[name] == version, pin
    uv_version = subprocess.run([_uv(), "--version"], capture_output=True, text=True).stdout.split()[1]
    assert f"=={uv_version}" == PYPROJECT["tool"]["uv"]["required-version"]


def test_dvc_stage_command_finds_the_project_interpreter_or_says_what_to_do(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX", "TCNN_PYTHON")}
    clean["PATH"] = "/usr/bin:/bin"
    ok = subprocess.run([str(REPO / "scripts" / "stage"), "prepare", "--help"], cwd=REPO, env=clean,
                        capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0 and "python -m stages.prepare" in ok.stdout
    (tmp_path / "scripts").mkdir()
    lone = tmp_path / "scripts" / "stage"
    lone.write_bytes((REPO / "scripts" / "stage").read_bytes())
    lone.chmod(0o755)
    bad = subprocess.run([str(lone), "prepare"], cwd=tmp_path, env=clean, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "stage prepare: no project interpreter (.venv/bin/python not found here or above): run 'make setup' "
        "first, or set TCNN_PYTHON"
    ]
