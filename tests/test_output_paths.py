"""Issue 59: every output path is checked before compute (core.utils.output_paths): `tcnn study run` refuses an
unwritable --out / --readme before its pilot, `tcnn study render` a README without the block before it draws,
`tcnn study export` an unwritable destination before it reads, `tcnn sweep` an unwritable sweep.storage before
Ray starts. One line, exit 2, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_study_results import _study

from core.utils.output_paths import OutputPathError, check_output_dir, check_output_file

REPO = Path(__file__).resolve().parents[1]


def tcnn(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_checks_try_what_they_check(tmp_path: Path) -> None:
    """/proc refuses a new file whatever the permission bits say (root passes os.access); a file is no folder;
    a folder to be created is fine below a writable one; the probe leaves nothing behind."""
    assert os.access("/proc", os.W_OK) or os.geteuid() != 0  # the bits would say yes to root
    with pytest.raises(OutputPathError, match=r"^--readme /proc/nope/R.md: cannot create files in /proc \("):
        check_output_file("/proc/nope/R.md", "--readme")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputPathError, match=rf"^--out {tmp_path}/f/sub: {tmp_path}/f is not a directory$"):
        check_output_dir(tmp_path / "f" / "sub", "--out")
    with pytest.raises(OutputPathError, match=rf"^--readme {tmp_path}: not a regular file$"):
        check_output_file(tmp_path, "--readme")
    with pytest.raises(OutputPathError, match=r"it has no <!-- study:x:begin -->"):
        check_output_file(tmp_path / "f", "--readme", holds=("<!-- study:x:begin -->",))
    check_output_dir(tmp_path / "a" / "b", "--out")
    check_output_file(tmp_path / "new.md", "--readme")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_study_run_refuses_an_unwritable_readme_or_out_before_the_pilot(tmp_path: Path) -> None:
    params = str(REPO / "pipelines" / "studies" / "tcnn_vs_control.yaml")
    for args, line in (
        (["--out", "o", "--readme", "/proc/nope/R.md"], "tcnn study: error: --readme /proc/nope/R.md: cannot create files in /proc"),
        (["--out", "/proc/nope"], "tcnn study: error: --out /proc/nope: cannot create files in /proc"),
    ):  # fmt: skip
        p = tcnn("study", "run", params, "--name", "x", *args, cwd=tmp_path)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith(line), (
            p.stderr
        )
    assert list(tmp_path.iterdir()) == []


def test_study_render_refuses_a_readme_without_the_block_before_drawing(tmp_path: Path) -> None:
    d = _study(tmp_path / "r")
    (tmp_path / "R.md").write_text("no block here\n")
    before = {p.name: p.stat().st_mtime_ns for p in d.iterdir()}
    p = tcnn("study", "render", str(d), "--readme", str(tmp_path / "R.md"), cwd=REPO)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"tcnn study: error: --readme {tmp_path / 'R.md'}: it has no <!-- study:toy:begin -->"
    ]
    assert {p.name: p.stat().st_mtime_ns for p in d.iterdir()} == before  # no figure drawn


def test_study_export_and_sweep_storage_refuse_before_reading_or_starting_ray(tmp_path: Path) -> None:
    p = tcnn("study", "export", str(tmp_path / "no-sweep"), "/proc/nope", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.strip() == (
        "tcnn study: error: OUT_DIR /proc/nope: cannot create files in /proc (No such file or directory)"
    )
    p = tcnn(
        "sweep", "--params", str(REPO / "params.yaml"), "-S", "sweep.storage=/proc/nope/sweeps", cwd=REPO
    )
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "tcnn sweep: error: sweep.storage /proc/nope/sweeps: cannot create files in /proc (No such file or directory)"
    ]
