"""`moerl config migrate`: rewrite a config file's moved keys (`trainer.MOVED`) to their new
places, in the file's sections and under its `modes:` block, keeping everything else."""

from __future__ import annotations

from typing import Any

from moerl.config.trainer import MOVED
from moerl.errors import ConfigError
from moerl.userfiles import short_repr


def moved_in(root: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], str]]:
    """The moved keys set in the config mapping `root`: (old dotted key, new dotted key, the
    mapping that holds the old key, its name there)."""
    out = []
    for old, new in MOVED.items():
        *parents, key = old.split(".")
        node: Any = root
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            out.append((old, new, node, key))
    return out


def _check_target(root: dict[str, Any], prefix: str, old: str, new: str) -> None:
    """Refuse a move whose new place is set already or lies under a key that is not a section."""
    *parents, key = new.split(".")
    node: Any = root
    for depth, part in enumerate(parents, 1):
        node = node.get(part)
        if node is None:
            return
        if not isinstance(node, dict):
            where = ".".join(parents[:depth])
            raise ConfigError(
                f"{prefix}{old} cannot move: {prefix}{where} is not a section "
                f"(it is {short_repr(node)})"
            )
    if key in node:
        raise ConfigError(
            f"{prefix}{old} and {prefix}{new} are both set: keep one (the new one) and migrate again"
        )


def _put(root: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, key = dotted.split(".")
    node = root
    for part in parents:
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
    node[key] = value


def migrate_mapping(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Move every moved key of `data` (and of each `modes:` entry) in place, returning the
    (old, new) dotted keys moved. A `ConfigError` when a key is set at both places (or two old
    keys move to one place) or its new section is not a mapping; `data` is then left unchanged."""
    roots: list[tuple[str, dict[str, Any]]] = [("", data)]
    modes = data.get("modes")
    if isinstance(modes, dict):
        roots += [(f"modes.{m}.", v) for m, v in modes.items() if isinstance(v, dict)]
    plan: list[tuple[str, dict[str, Any], str, dict[str, Any], str]] = []
    for prefix, root in roots:
        targets: dict[str, str] = {}
        for old, new, node, key in moved_in(root):
            _check_target(root, prefix, old, new)
            if new in targets:
                raise ConfigError(
                    f"{prefix}{targets[new]} and {prefix}{old} both move to {prefix}{new}: keep one "
                    "and migrate again"
                )
            targets[new] = old
            plan.append((prefix, root, old, node, key))
    for _, root, old, node, key in plan:
        _put(root, MOVED[old], node.pop(key))
    return [(prefix + old, prefix + MOVED[old]) for prefix, _, old, _, _ in plan]
