"""The README and the docs/ pages hold together: links resolve, the README stays short and links every page,
the params keys docs/configuration.md names exist, and the commands the pages show name real verbs, scripts
and make targets. Cheap: files are read, the `tcnn` parser is built once in this process."""

from __future__ import annotations

import functools
import inspect
import re
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 170

FENCE = re.compile(r"^\s*(```|~~~)\s*([\w-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
SHELL = {"bash", "sh", "shell", "console"}
FILE_SUFFIXES = tuple(
    f".{s}" for s in ("py", "md", "yaml", "json", "csv", "parquet", "pt", "png", "html", "txt")
)


def _blocks(text: str) -> tuple[str, list[tuple[str, list[str]]]]:
    """The prose with every fenced block blanked out, and the fenced blocks as (info string, lines)."""
    prose, blocks, info, body = [], [], None, []
    for line in text.splitlines():
        m = FENCE.match(line)
        if info is None and m:
            info, body = m.group(2).lower(), []
            prose.append("")
        elif info is not None and m and not m.group(2):
            blocks.append((info, body))
            info = None
            prose.append("")
        elif info is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    assert info is None, "a fenced block is not closed"
    return "\n".join(prose), blocks


def _prose(path: Path) -> str:
    """The page without fenced blocks and inline code (links inside code are not links)."""
    return re.sub(r"`[^`\n]*`", "", _blocks(path.read_text())[0])


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", heading.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _blocks(path.read_text())[0].splitlines():
        m = HEADING.match(line)
        if m:
            slug = _slug(m.group(2))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return frozenset(out)


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_every_relative_link_resolves_to_a_file_and_a_heading() -> None:
    assert DOCS, "no docs/ pages"
    bad = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not bad, "\n".join(bad)


def test_the_readme_is_short_and_links_every_docs_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into a docs/ page"
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _links(README)}
    unlinked = [p.name for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


# ------------------------------------------------------------------------------------- params keys


def _model_in(annotation: typing.Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _open_mapping(annotation: typing.Any) -> bool:
    """A field whose keys are free (a dict, Any): any path below it is the user's."""
    if (
        annotation is typing.Any
        or typing.get_origin(annotation) in (dict, typing.Mapping)
        or annotation is dict
    ):
        return True
    return any(_open_mapping(a) for a in typing.get_args(annotation))


def _in_schema(parts: list[str]) -> bool:
    from pipelines.sweep.sweep_params import SweepParams  # the science's sections and the sweep's, typed

    model: type[BaseModel] = SweepParams
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        sub = _model_in(field.annotation)
        if sub is None or i == len(parts) - 1:
            return i == len(parts) - 1 or _open_mapping(field.annotation)
        model = sub
    return True


def _in_yaml(raw: typing.Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(raw, dict) or part not in raw:
            return False
        raw = raw[part]
    return True


def test_every_params_key_docs_configuration_names_exists() -> None:
    """A backticked dotted path whose first part is a top-level params key (`finetune.lr`,
    `pretrain.source.mean/std`, `sweep.select: {...}`) is a key of params.yaml or of the params' schema
    (core/config/ and, for ``sweep``, pipelines/sweep/settings.py)."""
    from core.config import Params

    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    text = (REPO / "docs" / "configuration.md").read_text()
    dotted = r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+"
    checked, missing = set(), []
    for span in re.findall(r"`([^`\n]+)`", text):
        m = re.fullmatch(rf"({dotted})(?:/([a-z_][a-z0-9_]*))?(?:\.\*)?(?:\s*[:=].*)?", span.strip())
        if not m or m.group(1).split(".")[0] not in Params.model_fields or m.group(1).endswith(FILE_SUFFIXES):
            continue  # not a key path, or a file name (`robustness.parquet`)
        keys = [m.group(1)]
        if m.group(2):  # `pretrain.source.mean/std`: mean and std
            keys.append(f"{m.group(1).rsplit('.', 1)[0]}.{m.group(2)}")
        for key in keys:
            checked.add(key)
            parts = key.split(".")
            if not (_in_yaml(raw, parts) or _in_schema(parts)):
                missing.append(key)
    assert len(checked) >= 20, sorted(checked)  # the page does name keys: the pattern still finds them
    assert not missing, f"docs/configuration.md names params keys that do not exist: {sorted(set(missing))}"


# ---------------------------------------------------------------------------------------- commands


@functools.cache
def _tcnn_verbs() -> dict[str, frozenset[str]]:
    """`tcnn`'s verbs (and each verb's own verbs), from the parser `tcnn --help` prints."""
    import argparse

    from pipelines.cli import build_parser

    def verbs(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    parser = build_parser()
    top = verbs(parser)
    shown = parser.format_help()
    assert top and all(v in shown for v in top), shown
    return {name: frozenset(verbs(sub)) for name, sub in top.items()}


def _make_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9_-][\w.-]*)\s*:(?!=)", text, flags=re.M))


def _commands(path: Path) -> list[str]:
    """The shell lines of a page's fenced bash/console blocks: comments and heredoc bodies dropped,
    continuation lines joined; in a console block only the `$ ` lines."""
    out = []
    for info, body in _blocks(path.read_text())[1]:
        if info not in SHELL:
            continue
        lines, heredoc, pending = [], None, ""
        for line in body:
            if heredoc is not None:
                heredoc = None if line.strip() == heredoc else heredoc
                continue
            if info == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
            m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
            if m:
                heredoc = m.group(1)
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append(pending + line)
            pending = ""
        out += [x for x in lines if x.strip()]
    return out


def test_the_commands_the_pages_show_name_real_verbs_scripts_and_targets() -> None:
    verbs, targets = _tcnn_verbs(), _make_targets()
    assert {"run", "test", "setup"} <= targets, targets
    bad, seen = [], {"tcnn": 0, "make": 0, "path": 0}
    for page in PAGES:
        for cmd in _commands(page):
            where = f"{page.relative_to(REPO)}: {cmd.strip()}"
            for verb, sub in re.findall(
                r"(?:^|[\s;&|(])(?:\S*/)?tcnn\s+([a-z][\w-]*)(?:\s+([a-z][\w-]*))?", cmd
            ):
                seen["tcnn"] += 1
                if verb not in verbs:
                    bad.append(f"{where}: no `tcnn {verb}` (tcnn --help: {sorted(verbs)})")
                elif verbs[verb] and sub not in verbs[verb]:
                    bad.append(f"{where}: no `tcnn {verb} {sub}` ({sorted(verbs[verb])})")
            for target in re.findall(r"(?:^|[\s;&|(])make\s+([\w-]+)", cmd):
                seen["make"] += 1
                if target not in targets:
                    bad.append(f"{where}: no make target {target!r}")
            for rel in re.findall(
                r"(?<![\w./-])((?:scripts|infra|benchmarks|pipelines|stages)/[\w./-]*\w)", cmd
            ):
                seen["path"] += 1
                if not (REPO / rel).exists():
                    bad.append(f"{where}: no {rel}")
            for module in re.findall(r"python\s+-m\s+((?:stages|pipelines|benchmarks)\.[\w.]+)", cmd):
                if not (REPO / (module.replace(".", "/") + ".py")).is_file():
                    bad.append(f"{where}: no module {module}")
    assert all(seen.values()), seen  # the patterns still find what the pages show
    assert not bad, "\n".join(bad)


def test_the_default_runs_differences_quoted_in_the_pipeline_page_are_the_committed_ones() -> None:
    """docs/pipeline.md quotes T-CNN - control of the default `make run` with its intervals: each figure is the
    committed headline's (results/headline/tcnn-control.json, git-tracked, 0.01 pp as shown): a rerun that
    changes them changes the page."""
    import json

    text = " ".join((REPO / "docs/pipeline.md").read_text().split())
    quoted = re.search(r"T-CNN - control on that run \([^)]*\): (.*?)\.(?: |$)", text)
    assert quoted, "docs/pipeline.md no longer quotes the default run's differences"
    committed = json.loads((REPO / "results/headline/tcnn-control.json").read_text())
    shown = re.findall(
        r"(clean|mCA|mCE) ([+-]\d+\.\d\d) pp \[([+-]\d+\.\d\d), ([+-]\d+\.\d\d)\]", quoted.group(1)
    )
    assert [s[0] for s in shown] == ["clean", "mCA", "mCE"], quoted.group(1)
    for name, diff, low, high in shown:
        assert committed[f"tcnn-control {name}"] == f"{diff} [{low}, {high}]", name


def test_the_search_vs_grid_table_in_the_sweeps_page_is_the_committed_one() -> None:
    """docs/sweeps.md quotes the measured search-vs-grid comparison: every table line of the results file it
    links (benchmarks/results/search_vs_grid_*.md, written by benchmarks/search_vs_grid.py) is on the page, in
    order, so a rerun that changes the numbers changes the page."""
    text = (REPO / "docs" / "sweeps.md").read_text()
    linked = re.findall(r"\((\.\./benchmarks/results/search_vs_grid_[\w-]+\.md)\)", text)
    assert linked, "docs/sweeps.md no longer links a search_vs_grid results file"
    page = [line for line in text.splitlines() if line.startswith("|")]
    for rel in set(linked):
        rows = [line for line in (REPO / "docs" / rel).read_text().splitlines() if line.startswith("|")]
        assert len(rows) >= 8, rel  # two tables: 4 arm rows and 2 method rows, with their headers
        at = [page.index(r) if r in page else -1 for r in rows]
        assert -1 not in at, f"{rel}: table lines not on the page: {[r for r, i in zip(rows, at) if i < 0]}"
        assert at == sorted(at), f"{rel}: the page has its table lines in another order"


def test_the_search_demo_excerpts_in_the_sweeps_page_are_lines_of_its_committed_log() -> None:
    """docs/sweeps.md's smoke-size demo (a search, then --from-search) quotes its run's output: every line of its
    text blocks (but the "..." cuts) is a line of the log it links (benchmarks/results/sweep_demo_smoke.log), in
    the log's order, so the page shows what ran and a rerun that changes the output changes the page."""
    text = (REPO / "docs" / "sweeps.md").read_text()
    section = text.split("### A search, then its seeds", 1)[1].split("\n### ", 1)[0]
    (rel,) = set(re.findall(r"\((\.\./benchmarks/results/sweep_demo_smoke\.log)\)", section))
    log = (REPO / "docs" / rel).read_text().splitlines()
    blocks = re.findall(r"```text\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the search's and the grid's output"
    for block in blocks:
        at = -1
        for line in block.splitlines():
            if line == "...":
                continue
            if line.endswith("; MLflow parent run ..."):  # the run's id and URL cut
                line = line.removesuffix(" ...")
                hits = [i for i, x in enumerate(log) if i > at and x.startswith(line)]
            else:
                hits = [i for i, x in enumerate(log) if i > at and x == line]
            assert hits, f"{rel}: not a line of the log (after line {at}): {line!r}"
            at = hits[0]
