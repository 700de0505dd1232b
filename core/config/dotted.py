"""Dotted keys (``finetune.lr``) set in the raw params mapping: the one override path of `-S key=value`, of
`Params.with_overrides` and of the values a layer above varies (a sweep's grid)."""

from __future__ import annotations

from typing import Any

from core.config.base import ConfigError


def _set_flat(raw: dict[str, Any], key: str, value: Any, flat: tuple[str, ...]) -> bool:
    """``<map>.<dotted param>`` for a ``map`` of ``flat`` (a mapping whose keys are whole dotted keys, e.g. a
    sweep's grid): everything after the map's own key is one key of it."""
    for prefix in flat:
        head = f"{prefix}."
        if not key.startswith(head) or len(key) == len(head):
            continue
        node = raw
        *parents, leaf = prefix.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: {part} is not a mapping")
        if not isinstance(node.get(leaf), dict):
            node[leaf] = {}
        node[leaf][key[len(head) :]] = value
        return True
    return False


def set_dotted(
    raw: dict[str, Any], key: str, value: Any, *, create: bool = False, flat: tuple[str, ...] = ()
) -> None:
    """Set the dotted ``key`` of the raw params mapping. ``create``: a key params.yaml leaves at its default may
    be named (its sections are created; the model still rejects unknown keys); otherwise only existing keys,
    keys of an optional section left at null, and entries of ``options`` or of a ``flat`` map. ``flat``: the
    dotted keys of mappings whose own keys are dotted params (:func:`_set_flat`)."""
    if _set_flat(raw, key, value, flat):
        return
    node = raw
    *parents, leaf = key.split(".")
    opened = False  # an optional section left at null (e.g. pretrain.augment): its keys come from the model
    for part in parents:
        if node.get(part) is None and (part in node or create):
            node[part], opened = {}, True
        if not isinstance(node.get(part), dict):
            raise ConfigError(f"{key}: unknown key")
        node = node[part]
    free = bool(parents) and (parents[-1] == "options" or ".".join(parents) in flat)
    if leaf not in node and not (opened or create or free):
        raise ConfigError(f"{key}: unknown key")
    node[leaf] = value
