"""The house rules, as checks: import-linter's contracts (.importlinter: core/ in layers, core/ knows no
orchestration, stages/ know no cluster, the tracking adapter stages/tracking/ imports no stage, harness or
pipeline and is layered, pipelines/sweep/ and pipelines/studies/ in layers) and no import cycle among core's
modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[1]


def test_import_linter_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_core_has_no_import_cycle() -> None:
    """Depth-first search over core's module graph (imports inside functions included)."""
    g = grimp.build_graph("core", include_external_packages=False, cache_dir=None)
    edges = {
        m: {i for i in g.find_modules_directly_imported_by(m) if i.startswith("core")} for m in g.modules
    }
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        state[m] = 2
        path.pop()
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)
