"""Reading a params file: YAML read as DVC reads it (YAML 1.2 numbers, a key given twice refused), `-S key=value`
overrides, validation, and the workspace paths the params name. Every entry point (DVC stages, `tcnn` verbs,
Ray trials) calls :func:`load_params` (or the sweep's loader, built on :func:`read_params`) before any compute;
a bad file is one `ConfigError` line naming the file and the dotted key."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from core.config.base import DEFAULT_CODE, ConfigError
from core.config.dotted import set_dotted
from core.config.params import Params, validate_params

P = TypeVar("P", bound=Params)


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` with the value parsed as YAML (so `3`, `0.5`, `1e-4`, `true`, `[1, 2]` get their types), by
    the loader of the params files (:class:`ParamsLoader`), so a value reads the same in a file and in `-S`."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, value = text.split("=", 1)
    try:
        return key.strip(), yaml.load(value, Loader=ParamsLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({mark})") from None


#: YAML 1.2's float (core schema, section 10.3.2): a dot or an exponent, so ``1e-4`` and ``1E5`` are numbers.
#: YAML 1.1 (PyYAML) needs a dot, and reads ``1e-4`` as the string "1e-4" where DVC (YAML 1.2) reads a float.
_FLOAT_12 = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")


class ParamsLoader(yaml.SafeLoader):
    """YAML's safe loader reading numbers as YAML 1.2 (and DVC, which reads params.yaml too) does: ``1e-4``,
    ``5E-3``, ``1e5`` are floats, in a params file and in a ``-S`` value alike (block or flow style). Plain
    integers stay integers (PyYAML's int resolver is tried first); ``.inf`` / ``.nan`` keep their YAML 1.1
    spelling."""


ParamsLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_12, list("-+.0123456789"))


def read_yaml(text: str) -> Any:
    """``text`` as :class:`ParamsLoader` reads it (numbers as in a params file)."""
    return yaml.load(text, Loader=ParamsLoader)  # noqa: S506 - a SafeLoader subclass


class _UniqueKeyLoader(ParamsLoader):
    """The params loader (:class:`ParamsLoader`), refusing a key given twice in one mapping (``{epochs: 1,
    epochs: 7}``: plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_error(path: Path, text: str, err: yaml.YAMLError) -> ConfigError:
    """One line: where (the line of the problem, or of the last line when the file ends early) and what."""
    mark = getattr(err, "problem_mark", None)
    where = ""
    if mark is not None:
        last = max(1, len(text.rstrip("\n").splitlines()))
        where = f" at line {min(mark.line + 1, last)}"
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ConfigError(f"{path}: not valid YAML{where}: {what}")


def check_workspace_paths(params: Params, workspace: Path | None = None) -> None:
    """What the params name in the workspace and must find there before anything runs (docs/configuration.md):
    ``model.code``, a DVC dependency of the stages that build the network, is relative to the workspace and
    stays inside it (no absolute path, no ``..``: DVC would hash another file, and an absolute path changes
    with the clone); in a DVC workspace whose dvc.yaml depends on it (``${model.code}``, where `dvc repro`
    runs the stages) it exists (DVC would fail at the first stage with its own error) and no symlink leads it outside.
    Outside a DVC workspace (a stage run alone from another folder) it is no dependency and is not looked for.
    Called by :func:`load_params`, not by the model: a sweep's trials get it absolute (pipelines/sweep/plan.py)."""
    rel = params.model.code
    if rel.is_absolute() or os.path.normpath(rel).split(os.sep)[0] == "..":
        raise ConfigError(f"model.code: {rel} is not inside the workspace: give the network's code as a path "
                          f"relative to it (a DVC dependency; e.g. {DEFAULT_CODE})")  # fmt: skip
    root = (workspace or Path.cwd()).resolve()
    try:  # a DVC workspace whose stages depend on it (dvc.yaml reads ``${model.code}``)
        if "${model.code}" not in (root / "dvc.yaml").read_text():
            return
    except (OSError, UnicodeDecodeError):
        return
    code = root / rel
    if not code.exists():
        raise ConfigError(f"model.code: {params.model.code} does not exist in the workspace {root} (the file or "
                          f"folder of model.arch's code; the default is {DEFAULT_CODE})")  # fmt: skip
    if not code.resolve().is_relative_to(root):
        raise ConfigError(f"model.code: {params.model.code} leads outside the workspace ({code.resolve()}): "
                          "keep the network's code in the workspace")  # fmt: skip


def read_params(
    path: str | os.PathLike, overrides: list[str] | None = None, flat: tuple[str, ...] = ()
) -> Any:
    """The raw mapping of the params file ``path`` with ``overrides`` (``key=value``) set; ``flat``: the dotted
    keys of mappings whose keys are whole dotted params (`core.config.dotted.set_dotted`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a directory, not a params file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: cannot read the params file ({type(err).__name__})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise _yaml_error(path, text, err) from None
    if raw is None:
        raw = {}
    if overrides:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        for text in overrides:
            key, value = parse_override(text)
            set_dotted(raw, key, value, create=True, flat=flat)
    return raw


def load_as(
    path: str | os.PathLike,
    overrides: list[str] | None,
    validate: Callable[[Any], P],
    flat: tuple[str, ...] = (),
) -> P:
    """The params file ``path`` (with ``overrides``) validated by ``validate`` and its workspace paths checked
    (:func:`check_workspace_paths`); an error names the file."""
    raw = read_params(path, overrides, flat)
    try:
        params = validate(raw)
        check_workspace_paths(params)
    except ConfigError as err:
        raise ConfigError(f"{Path(path)}: {err}") from None
    return params


def load_params(path: str | os.PathLike = "params.yaml", overrides: list[str] | None = None) -> Params:
    """The science's params of the file ``path`` (the ``sweep`` section carried as written)."""
    return load_as(path, overrides, validate_params)
