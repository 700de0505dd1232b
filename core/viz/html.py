"""HTML pages from the templates in ``core/viz/templates`` (Jinja2), and the number formats they show.

Both reports render through :func:`render`: the run report (``stages/report.py``, ``run_report.html``) and the
sweep report (``pipelines/sweep/sweep_report.py``, ``sweep_report.html``). They share the page skeleton and the
stylesheet (``base.html``) and the table, image and notes macros (``macros.html``), so they look alike.

Autoescaping is on: every value a template prints is HTML-escaped unless it is :class:`markupsafe.Markup`.
What :func:`render` returns is Markup, so a rendered fragment can be passed into another template as is;
:func:`fmt_diff` returns Markup when it makes the text bold. Callers that build a cell holding HTML build it
with ``Markup("<code>{}</code>").format(value)``, which escapes ``value``.

The ``fmt_*`` functions are also the templates' filters (:data:`FILTERS`): ``{{ x|pct }}``, ``{{ x|num }}``...
This module imports only Jinja2, MarkupSafe and the standard library.
"""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Mapping
from typing import Any

import jinja2
from markupsafe import Markup


def finite(v: Any) -> bool:
    """A real, finite number (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ------------------------------------------------------------------------------------------------ formats
def fmt_pct(v: Any, digits: int = 2) -> str:
    """0.91234 -> '91.23%' (None / nan -> 'n/a')."""
    return f"{100 * v:.{digits}f}%" if finite(v) else "n/a"


def fmt_sci(v: Any) -> str:
    """0.000123 -> '1.230e-04' (None / nan -> 'n/a')."""
    return f"{v:.3e}" if finite(v) else "n/a"


def fmt_num(v: Any, digits: int = 4) -> str:
    """An int with thousands separators, a float to `digits` significant digits, anything else as text
    (None / nan -> 'n/a')."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v) if v is not None else "n/a"
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:.{digits}g}" if math.isfinite(v) else "n/a"


def fmt_delta_pp(a: Any, b: Any) -> str:
    """Difference b - a of two fractions in percentage points, signed."""
    return f"{100 * (b - a):+.2f} pp" if finite(a) and finite(b) else "n/a"


def fmt_diff(d: Mapping[str, Any] | None, kind: str = "acc") -> str:
    """A difference with its 95% interval: '+0.42 pp [-0.10, +0.95]', Markup in bold when the interval
    excludes 0. `kind` 'acc' or 'err': fractions shown in percentage points; anything else (a relative gain):
    in percent."""
    if not d or not finite(d.get("diff")):
        return "n/a"
    unit = " pp" if kind in ("acc", "err") else " %"
    text = f"{100 * d['diff']:+.2f}{unit} [{100 * d['low']:+.2f}, {100 * d['high']:+.2f}]"
    return Markup("<b>{}</b>").format(text) if d.get("excludes_zero") else text


def fmt_pct_plain(v: Any) -> str:
    """A fraction as a percentage without the sign, for columns headed '(%)': 0.9 -> '90.00' (None -> '-')."""
    return "-" if v is None else f"{100 * float(v):.2f}"


def fmt_plain(v: Any) -> str:
    """A table value as is, floats to 4 significant digits (None -> '-')."""
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def b64(data: bytes) -> str:
    """Bytes as base64 text, for ``data:`` URIs (images embedded so a page travels as one file)."""
    return base64.b64encode(data).decode("ascii")


FILTERS = {
    "pct": fmt_pct,
    "sci": fmt_sci,
    "num": fmt_num,
    "delta_pp": fmt_delta_pp,
    "diff": fmt_diff,
    "pct_plain": fmt_pct_plain,
    "plain": fmt_plain,
    "b64": b64,
}


# ------------------------------------------------------------------------------------------------ rendering
@functools.cache
def environment() -> jinja2.Environment:
    """The one environment of the templates (loaded once; StrictUndefined, so a misspelt name fails the
    render instead of printing nothing)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("core.viz", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(FILTERS)
    return env


def render(template_name: str, /, **context: Any) -> Markup:
    """The template `template_name` rendered with `context`; Markup, so it can go into another template."""
    return Markup(environment().get_template(template_name).render(**context))
