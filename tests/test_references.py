"""Papers are cited by keys that docs/references.md defines (no project-internal numbering)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEY = re.compile(r"\[([A-Z][A-Za-z]+\d\d)\]")
OLD = re.compile(r"(?<![\w.,/\-+])00[0-4],? (Sec|Eq|Table|Fig|SM|Lemma|Theorem|Appendix)\b")


def _sources() -> list[Path]:
    return [p for d in ("core", "stages", "pipelines", "benchmarks") for p in (REPO / d).rglob("*.py")]


def test_every_cited_key_is_in_the_references_table() -> None:
    table = (REPO / "docs" / "references.md").read_text()
    defined = set(re.findall(r"^\| \[(\w+)\] \|", table, flags=re.M))
    assert {"TCNN21", "ConViT21", "Li21", "Cordonnier20", "Bello19"} <= defined
    used: dict[str, str] = {}
    for path in _sources():
        for key in KEY.findall(path.read_text()):
            used.setdefault(key, str(path.relative_to(REPO)))
    missing = {k: where for k, where in used.items() if k not in defined}
    assert not missing, f"cited but not in docs/references.md: {missing}"
    assert "TCNN21" in used and "ConViT21" in used


def test_no_paper_is_cited_by_the_projects_internal_number() -> None:
    left = [f"{p.relative_to(REPO)}: {m.group(0)}" for p in _sources() for m in OLD.finditer(p.read_text())]
    assert not left, left[:10]
