"""scripts/gpu_check.sh, the CUDA check, runs here as its CPU dry run: the same steps at tiny sizes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from gpu_throughput import junit_table, readme_table  # noqa: E402


@pytest.mark.slow
def test_dry_run_prints_every_configuration_and_an_exact_conversion(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([str(REPO / "scripts/gpu_check.sh"), "--dry-run"], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    rows = [
        r for r in table.splitlines() if re.match(r"\| resnet(50|12_cifar_os16) \| \d+ \| (train|eval) ", r)
    ]
    # 2 networks x 2 modes x 2 precisions x channels-last off/on, each with the CNN and T-CNN rates
    assert len(rows) == 16
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        cnn, tcnn, ratio = float(cells[6]), float(cells[7]), float(cells[8])
        assert cnn > 0 and tcnn > 0 and ratio == pytest.approx(tcnn / cnn, rel=0.2, abs=0.01)
    exact = re.findall(r"\| (resnet\S+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([\d.]+) \|", table)
    assert [e[0] for e in exact] == ["resnet50", "resnet12_cifar_os16"]
    for _, fp32, tf32, scale in exact:  # the T-CNN at alpha = lambda = 50 is the CNN to float32 rounding
        assert float(fp32) <= 1e-5 * max(1.0, float(scale)) and float(tf32) <= 1e-5 * max(1.0, float(scale))
    assert "test_cuda_matches_cpu_and_autocast[tcnn] | skipped" in table


def test_the_tests_table_reads_a_junit_report(tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok" time="1.5"/>'
        '<testcase classname="tests.test_a" name="test_bad" time="0.5"><failure message="assert 1 == 2&#10;more"/>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="test_cuda" time="0"><skipped message="needs a CUDA device"/>'
        "</testcase></testsuite></testsuites>"
    )
    lines = junit_table(junit)
    assert lines[0] == "tests: 1 FAILED, 1 passed, 1 skipped"
    assert "| test_a::test_ok | passed | 1.5 |  |" in lines
    assert "| test_a::test_bad | FAILED | 0.5 | assert 1 == 2 |" in lines
    assert "| test_b::test_cuda | skipped | 0.0 | needs a CUDA device |" in lines


def test_the_docs_table_is_the_committed_gpu_run() -> None:
    """docs/scale.md's "Measured on one NVIDIA H200" table is generated from
    benchmarks/results/gpu_check_h200.md, the device's own output of scripts/gpu_check.sh (every stage test
    passed there)."""
    committed = (REPO / "benchmarks/results/gpu_check_h200.md").read_text()
    assert committed.startswith("device: NVIDIA H200") and "tests: 139 passed" in committed
    assert readme_table(committed) in (REPO / "docs" / "scale.md").read_text()
