"""Models: the kind registry (`core.models.kinds`: names and references only, imports nothing heavy), the factory
(`core.models.factory.build`), checkpoint specs (`core.models.spec`), the CNNs, ConViT, the Attention
Augmented ResNet and the conv -> attention conversion (`core.models.conversion`).

Layer: imports ``core.nn`` and ``core.utils``. Import from the submodules: this package's import loads nothing,
so the configuration can read the kind names without loading a network. ``core.models.build`` (DESIGN section
4) resolves to `core.models.factory.build` on first use.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build":
        from core.models.factory import build

        return build
    raise AttributeError(f"module 'core.models' has no attribute {name!r}")
