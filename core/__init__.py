"""The science of tcnn, importable alone (torch, timm, numpy, pyarrow, imagecorruptions).
Never imports ray, mlflow, dvc or submitit.

Importing core registers the science's answers to the config's questions (`core.config.rules`): each science
package that has a ``config_rules`` module answers there, and is found by that name, not listed here. They
load by reference, as the kind registry's code does (core.models.kinds), so a stage's DVC inputs stay the code
its outputs come from (tests/test_dvc_deps.py): the answers only refuse bad params before any compute."""

import importlib
import importlib.util
import pkgutil

for _package in pkgutil.iter_modules(__path__):
    if _package.ispkg and importlib.util.find_spec(f"{__name__}.{_package.name}.config_rules") is not None:
        importlib.import_module(f"{__name__}.{_package.name}.config_rules")
