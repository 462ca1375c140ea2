"""`moerl config migrate`: rewrite a config file's moved keys (`trainer.MOVED`) to their new
places, in the file's sections and under its `modes:` block, keeping everything else."""

from __future__ import annotations

from typing import Any

from moerl.config.trainer import MOVED
from moerl.errors import ConfigError
from moerl.userfiles import short_repr


def migrate_mapping(data: dict[str, Any]) -> list[tuple[str, str]]:
    """Move every moved key of `data` (and of each `modes:` entry) in place, returning the
    (old, new) dotted keys moved. A `ConfigError` when a key is set at both places or its new
    section is not a mapping; `data` is then left unchanged."""
    roots: list[tuple[str, dict[str, Any]]] = [("", data)]
    modes = data.get("modes")
    if isinstance(modes, dict):
        roots += [(f"modes.{m}.", v) for m, v in modes.items() if isinstance(v, dict)]
    plan: list[tuple[str, str, dict[str, Any], str, str]] = []
    for prefix, root in roots:
        for old, new in MOVED.items():
            section, key = old.split(".", 1)
            node = root.get(section)
            if not isinstance(node, dict) or key not in node:
                continue
            sub = new.split(".")[1]
            target = node.get(sub)
            if target is not None and not isinstance(target, dict):
                raise ConfigError(
                    f"{prefix}{old} cannot move: {prefix}{section}.{sub} is not a section "
                    f"(it is {short_repr(target)})"
                )
            if isinstance(target, dict) and key in target:
                raise ConfigError(
                    f"{prefix}{old} and {prefix}{new} are both set: keep one (the new one) and "
                    "migrate again"
                )
            plan.append((prefix + old, prefix + new, node, sub, key))
    for _old, _new, node, sub, key in plan:
        node.setdefault(sub, {})
        if node[sub] is None:
            node[sub] = {}
        node[sub][key] = node.pop(key)
    return [(old, new) for old, new, *_ in plan]
