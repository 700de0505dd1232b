"""Every figure and page: robustness gains and contact sheets, training curves, GPSA dynamics, attention maps,
and the HTML reports (`html`: one Jinja2 environment over the templates in ``core/viz/templates``).

Layer: imports ``core.analysis``, ``core.robustness`` and ``core.utils``."""
