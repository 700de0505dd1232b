"""`tcnn show metrics|plots` (pipelines/views.py): a missing headline or page template is one line naming the
file and the command that brings it back, exit 2, before DVC runs (issue 59, item 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.cli import main


def test_a_missing_headline_names_it_and_its_commands(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["show", "metrics"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(
        "tcnn show metrics: error: results/headline/ (the headline, DVC's only metrics) is missing"
    )
    assert "`git checkout -- results/headline`" in line and "`.venv/bin/dvc repro evaluate`" in line
    (tmp_path / "results" / "headline").mkdir(parents=True)
    assert main(["show", "metrics"]) == 2
    assert "results/headline/ (the headline, DVC's only metrics) is empty" in capsys.readouterr().err


@pytest.mark.parametrize("page", [None, "<html>no placeholder</html>"])
def test_a_missing_or_foreign_page_template_names_it_and_its_command(
    tmp_path: Path, monkeypatch, capsys, page: str | None
) -> None:
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text(
        "[plots]\n    html_template = ../infra/dvc/plots/offline.html\n"
    )
    if page is not None:
        (tmp_path / "infra/dvc/plots").mkdir(parents=True)
        (tmp_path / "infra/dvc/plots/offline.html").write_text(page)
    monkeypatch.chdir(tmp_path)
    assert main(["show", "plots", "--open"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("tcnn show plots: error: infra/dvc/plots/offline.html ")
    assert ("is missing" if page is None else "no {plot_divs}") in line
    assert line.endswith(("`.venv/bin/python scripts/dvc_plots_page.py` writes it", "writes it again"))


def test_the_repository_page_is_the_one_the_check_reads(repo_root: Path) -> None:
    """The check reads .dvc/config as DVC does: here it names the page scripts/dvc_plots_page.py writes."""
    from pipelines.views import template_of

    assert template_of(repo_root) == repo_root / "infra/dvc/plots/offline.html"
