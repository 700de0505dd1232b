"""Stage `check`: what the params name that no training needs, checked before any training runs.

    python -m stages.check [--params params.yaml] [-S key=value]

Today that is a published robustness benchmark (``robustness.public``: its .npy headers and labels against the
prepared data's image shape and classes; stages.published_check), which evaluate would otherwise refuse only
after pretraining and fine-tuning. `tcnn validate` runs the same check.

The stage writes one small file whose content never changes (:data:`PASSED`): pretrain depends on it, so
`dvc repro` runs this stage after prepare and before pretrain, while an edit of the checking code (or of the
published-set reader it imports) reruns only this stage -- DVC finds the same file and leaves pretraining
alone. No MLflow run: it computes nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from core.config import Params
from core.utils.atomic import atomic_write_json
from stages.harness import chain
from stages.harness.runner import stage_main
from stages.published_check import check_public_before_training

NAME = "check"
#: The stage's one output, the same bytes after every passing run (its DVC hash never changes).
PASSED = {"passed": ["robustness.public: the published benchmark's files fit the dataset (when set)"]}


def check(params: Params, root: Path = Path(".")) -> None:
    """Every check of this stage (a `StageError` naming the file and the param at the first failure)."""
    check_public_before_training(params, root)


def run(params: Params, *, root: Path = Path(".")) -> dict[str, Any]:
    """Write :data:`PASSED` (the checks ran in `stage_main`'s ``check``, before anything was written)."""
    atomic_write_json(root / chain.output(NAME, "passed.json"), PASSED)
    public = params.robustness.public
    said = f"robustness.public {public.dir}" if public is not None else "no published benchmark"
    print(f"check: ok ({said})")
    return {}


def main(argv: list[str] | None = None) -> int:
    return stage_main(NAME, run, argv, check=check, tracked=False)


if __name__ == "__main__":
    sys.exit(main())
