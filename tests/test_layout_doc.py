"""docs/layout.md cannot drift: its module index is the modules' own docstrings, and what its overview names
exists (issue 60, item 6)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("layout_doc", ROOT / "scripts" / "layout_doc.py")
L = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(L)


def test_the_module_index_is_what_the_code_says() -> None:
    assert L.main(["--check"]) == 0, "run .venv/bin/python scripts/layout_doc.py"


def test_every_module_is_in_the_index_once() -> None:
    text = (ROOT / "docs" / "layout.md").read_text()
    index = text.split(L.BEGIN, 1)[1].split(L.END, 1)[0]
    listed = re.findall(r"^\| `([^`]+\.py)` \|", index, flags=re.M)
    on_disk = sorted(p.relative_to(ROOT).as_posix() for top in L.FOLDERS for p in (ROOT / top).rglob("*.py")
                     if "__pycache__" not in p.parts and (p.name != "__init__.py" or p.read_text().strip()))  # fmt: skip
    assert sorted(listed) == on_disk


def test_every_file_the_overview_names_exists() -> None:
    overview = (ROOT / "docs" / "layout.md").read_text().split(L.BEGIN, 1)[0]
    names = {p.name for top in L.FOLDERS for p in (ROOT / top).rglob("*.py")}
    paths = set(re.findall(r"`([\w/.]+\.py)`", overview)) | set(re.findall(r"\(`?([\w/]+\.py)", overview))
    missing = [p for p in sorted(paths) if not (ROOT / p).is_file() and Path(p).name not in names]
    assert not missing, f"docs/layout.md names files that do not exist: {missing}"


def test_first_sentence_stops_at_a_sentence_end_only() -> None:
    doc = "Heads ([TCNN21] Sec. 2, e.g. a 3x3 conv) over ``layer1`` ... ``layerN``. Then more.\n\nNot this."
    assert L.first_sentence(doc) == "Heads ([TCNN21] Sec. 2, e.g. a 3x3 conv) over ``layer1`` ... ``layerN``."
    assert L.first_sentence("Is it the same function? Yes.") == "Is it the same function?"
    assert L.first_sentence("No full stop at all") == "No full stop at all"
