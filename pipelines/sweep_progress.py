"""The old path of pipelines/sweep/progress.py, which a sweep saved before pipelines/sweep/ became a package
names in its ``tuner.pkl`` (Ray Tune pickles the callback by module path): kept so that such a sweep resumes."""

from pipelines.sweep.progress import SweepProgress

__all__ = ["SweepProgress"]
