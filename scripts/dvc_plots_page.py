"""Write the HTML page template `dvc plots show` renders into (.dvc/config: ``plots.html_template``), with Vega,
Vega-Lite and Vega-Embed inlined, so the page draws on a machine without internet (DVC's own page loads them
from a CDN and is blank offline).

The libraries come from the locked ``vl-convert-python`` wheel (uv.lock: version and sha256), which carries
them as one script (``vl_convert.javascript_bundle``: it sets ``window.vegaEmbed``, what DVC's plot divs
call). The page is generated at set-up (scripts/setup.sh), not committed (third-party code, ~0.9 MB), and
rewritten only when the wheel's version changes.

    .venv/bin/python scripts/dvc_plots_page.py [--check]

``--check``: exit 1 (one line) unless the page exists and matches the installed wheel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "infra" / "dvc" / "plots" / "offline.html"
#: The Vega-Lite major version of DVC's plot templates ("$schema": .../vega-lite/v5.json) and of ours.
VEGA_LITE = "5.21"

TEMPLATE = """<!DOCTYPE html>
<!-- {stamp} -->
<html>
<head>
    {{refresh_tag}}
    <meta charset="utf-8">
    <title>DVC Plot</title>
    <script>
{bundle}
    </script>
    <style>
        table {{
            border-spacing: 15px;
        }}
    </style>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def stamp() -> str:
    """What the page was made from: the wheel's version and the libraries it bundles."""
    import vl_convert as vlc

    return (
        f"tcnn offline DVC plots page: vl-convert-python {vlc.__version__}, Vega {vlc.get_vega_version()}, "
        f"Vega-Lite {VEGA_LITE}, Vega-Embed {vlc.get_vega_embed_version()}"
    )


def page() -> str:
    """The template: DVC fills ``{plot_divs}`` and ``{refresh_tag}``; it has no ``{scripts}`` placeholder, so
    DVC's CDN script tags are left out."""
    import vl_convert as vlc

    bundle = vlc.javascript_bundle(vl_version=VEGA_LITE)
    if "</script" in bundle.lower():  # would end the inline script early
        raise SystemExit("dvc_plots_page: the bundle holds '</script>': cannot inline it")
    return TEMPLATE.format(stamp=stamp(), bundle=bundle)


def current() -> bool:
    return PAGE.is_file() and stamp() in PAGE.read_text(errors="replace")[:400]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless the page is current")
    args = ap.parse_args(argv)
    if args.check:
        if current():
            return 0
        print(f"dvc_plots_page: {PAGE} is missing or stale: run scripts/setup.sh", file=sys.stderr)
        return 1
    if not current():
        from core.utils.atomic import atomic_write_text

        atomic_write_text(PAGE, page())
        print(f"setup: {PAGE.relative_to(REPO)} <- {stamp()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
