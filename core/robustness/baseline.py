"""The CE baseline: the errors of the normalising model of the corruption-error metrics (Hendrycks & Dietterich
2019, "Benchmarking neural network robustness to common corruptions"; core.robustness.metrics).

AlexNet on ImageNet-C (:meth:`Baseline.alexnet`, per-severity errors embedded below, equal to
``reference/alexnet_imagenet_c_errors.json``) or, on any other data set, a frozen baseline of the project: its
19 x 5 errors and clean error from an evaluation table (:meth:`Baseline.from_table`), stored with
:meth:`Baseline.save`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from core.robustness.corruptions import CORRUPTIONS
from core.robustness.eval_table import model_rows
from core.utils.atomic import atomic_write_json

# AlexNet top-1 error on ImageNet-C per severity 1..5 (hendrycks/robustness; the per-corruption means are the
# usual CE normalisers) and on clean ImageNet validation.
_ALEXNET_CLEAN = 0.4348
_ALEXNET = {
    "gaussian_noise": (0.69528, 0.82542, 0.93554, 0.98138, 0.99452),
    "shot_noise": (0.71224, 0.85108, 0.93574, 0.98182, 0.99146),
    "impulse_noise": (0.78374, 0.89808, 0.9487, 0.9872, 0.99548),
    "defocus_blur": (0.65624, 0.73202, 0.85036, 0.91364, 0.94714),
    "glass_blur": (0.64308, 0.75054, 0.88806, 0.91622, 0.93344),
    "motion_blur": (0.5843, 0.70048, 0.82108, 0.8975, 0.92638),
    "zoom_blur": (0.70008, 0.76992, 0.80784, 0.84198, 0.87198),
    "snow": (0.71726, 0.88392, 0.86468, 0.9187, 0.94952),
    "frost": (0.6139, 0.79734, 0.8879, 0.89942, 0.9343),
    "fog": (0.67474, 0.7605, 0.84378, 0.8726, 0.945),
    "brightness": (0.4514, 0.48502, 0.54048, 0.62166, 0.7244),
    "contrast": (0.64548, 0.7615, 0.88874, 0.9776, 0.9927),
    "elastic_transform": (0.52596, 0.70116, 0.55686, 0.64076, 0.80554),
    "pixelate": (0.52218, 0.5462, 0.73728, 0.87092, 0.91262),
    "jpeg_compression": (0.51002, 0.54718, 0.57294, 0.65458, 0.74778),
}


# ----------------------------------------------------------------------------------------------------------
# Baselines
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Baseline:
    """Errors of the normalising model: ``errors[corruption][severity]`` and the clean error."""

    name: str
    clean_error: float
    errors: Mapping[str, Mapping[int, float]] = field(default_factory=dict)

    @classmethod
    def alexnet(cls) -> Baseline:
        """AlexNet on ImageNet-C (the 15 benchmark corruptions; no trusted per-severity extras exist)."""
        return cls(
            "alexnet",
            _ALEXNET_CLEAN,
            {c: {s + 1: e for s, e in enumerate(v)} for c, v in _ALEXNET.items()},
        )

    @classmethod
    def from_table(cls, table: pa.Table, model: str | None = None, name: str | None = None) -> Baseline:
        """A frozen baseline from an :func:`core.robustness.evaluation.evaluate_model` table (all its corruptions and severities)."""
        rows = model_rows(table, model)
        clean = [r for r in rows if r["corruption"] == "clean"]
        if not clean:
            raise ValueError("Baseline.from_table: the table has no clean row")
        errors: dict[str, dict[int, float]] = {}
        for r in rows:
            if r["corruption"] != "clean":
                errors.setdefault(r["corruption"], {})[int(r["severity"])] = float(r["error"])
        return cls(name or rows[0]["model"], float(clean[0]["error"]), errors)

    def to_dict(self) -> dict[str, Any]:
        """The reference JSON layout: ``{"name", "clean", "per_severity": {corruption: [e1, .., e5]}}``
        (missing severities as null)."""
        per = {
            c: [self.errors[c].get(s) for s in range(1, 6)] for c in CORRUPTIONS if c in self.errors
        }  # fmt: skip
        return {"name": self.name, "clean": self.clean_error, "per_severity": per}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str | None = None) -> Baseline:
        try:
            per = d["per_severity"]
            errors = {
                c: {s + 1: float(e) for s, e in enumerate(v) if e is not None} for c, v in per.items()
            }  # fmt: skip
            return cls(name or str(d.get("name", "baseline")), float(d["clean"]), errors)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"baseline: expected {{'clean', 'per_severity'}}, got {err!r}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON, atomically."""
        return atomic_write_json(path, self.to_dict(), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Baseline:
        path = Path(path)
        try:
            return cls.from_dict(json.loads(path.read_text()), name=None)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: baseline file not found") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None


def as_baseline(baseline: Any) -> Baseline | None:
    """The :class:`Baseline` a ``baseline`` argument names: itself, "alexnet", a baseline JSON path, a model's
    evaluation table, a dict in the reference layout, or None."""
    if baseline is None or isinstance(baseline, Baseline):
        return baseline
    if isinstance(baseline, str):
        if baseline == "alexnet":
            return Baseline.alexnet()
        return Baseline.load(baseline)
    if isinstance(baseline, os.PathLike):
        return Baseline.load(baseline)
    if isinstance(baseline, pa.Table):
        return Baseline.from_table(baseline)
    if isinstance(baseline, Mapping):
        return Baseline.from_dict(baseline)
    raise TypeError(
        f"baseline: expected Baseline, 'alexnet', a path, a table or a dict, got {type(baseline)}"
    )
