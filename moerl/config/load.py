"""Loading a run config: YAML files, `--set` overrides, the `modes:` block, JSON transport,
flattening for MLflow, and one-line validation errors naming the dotted key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from moerl.config.migrate import moved_in
from moerl.config.run import RunConfig
from moerl.errors import ConfigError
from moerl.userfiles import (
    FileProblem,
    decode_text,
    kind_problem,
    one_line,
    read_bytes_capped,
    short_repr,
    yaml_problem,
)


def _format_error(err: ValidationError) -> str:
    # One line whatever the input: keys are escaped (a YAML key may hold a newline) and quoted
    # values are bounded (a YAML alias bomb must not be expanded into the message).
    lines = []
    for e in err.errors(include_url=False):
        loc = ".".join(one_line(str(p)) for p in e["loc"]) or "<root>"
        msg = one_line(e["msg"])
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _section_for(e["loc"][:-1])
            if parent is not None:
                msg += f"; allowed keys: {', '.join(sorted(parent.model_fields))}"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {short_repr(e.get('input'))})"
        lines.append(f"{loc}: {msg}")
    if len(lines) > _MAX_REPORTED_ERRORS:  # a wrong file can have thousands of bad keys
        lines[_MAX_REPORTED_ERRORS:] = [f"and {len(lines) - _MAX_REPORTED_ERRORS} more"]
    return "invalid config: " + "; ".join(lines)


_MAX_REPORTED_ERRORS = 8


def _section_for(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def moved_key_problem(data: dict[str, Any]) -> str | None:
    """The keys of a config mapping that have moved (`trainer.MOVED`), one line naming each new
    place; None when there are none. Whatever brought the key in (the file, its `modes:` block,
    `--set`, the run form's overrides) ends here, so this is the one place that refuses them."""
    lines = [f"{old}: moved to {new}" for old, new, _, _ in moved_in(data)]
    if not lines:
        return None
    return "; ".join(lines) + " (moerl config migrate FILE rewrites a file)"


def parse_config(data: dict[str, Any] | None) -> RunConfig:
    """Validate a config mapping, raising `ConfigError` that names each bad key (a moved key
    names its new place)."""
    data = _as_mapping(data)
    moved = moved_key_problem(data)
    if moved:
        raise ConfigError(moved)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    except RecursionError:
        raise ConfigError("invalid config: nested too deeply to be a run config") from None


def _as_mapping(data: Any) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"invalid config: the top level must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`section.key=value` overrides (value parsed as YAML) merged into a config mapping."""
    for item in overrides:
        shown = short_repr(item)
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"--set {shown}: expected dotted.key=value, e.g. trainer.optimizer.learning_rate=0.001"
            )
        parts = [part.strip() for part in key.strip().split(".")]
        if not all(parts):
            raise ConfigError(
                f"--set {shown}: empty key part in {short_repr(key)}; expected dotted.key=value, "
                "e.g. trainer.optimizer.learning_rate=0.001"
            )
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"--set {shown}: the value is not valid YAML ({yaml_problem(err)}); quote a string "
                "value, e.g. --set 'tracking.run_name=\"[a]\"'"
            ) from None
        except RecursionError:
            raise ConfigError(f"--set {shown}: the value is nested too deeply") from None
        node = data
        *parents, leaf = parts
        for depth, part in enumerate(parents, 1):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(
                    f"--set {shown}: {'.'.join(parts[:depth])} is not a section "
                    f"(it is {short_repr(node)}), so it has no key {parts[depth]!r}"
                )
        node[leaf] = value
    return data


# A run config is a few KiB of YAML; anything past this is a wrong file, not a config.
MAX_CONFIG_BYTES = 1 << 20


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


MODES = ("sync", "async")


def apply_mode(data: dict[str, Any], mode: str | None) -> dict[str, Any]:
    """Resolve the `modes:` block: `modes: {async: {...}, sync: {...}}` holds per-mode settings
    merged over the rest of the file for the selected mode (`mode`, else `pipeline.mode`, else
    sync), which is written into `pipeline.mode`. One file describes one workload in both
    modes; what only suits one (a clip range tuned to the engine-start cost) goes under it."""
    modes = data.pop("modes", None) or {}
    if not isinstance(modes, dict) or any(
        k not in MODES or not isinstance(v, dict) for k, v in modes.items()
    ):
        raise ConfigError(
            f"modes: must map {' or '.join(MODES)} to a mapping of config sections, "
            f"got {short_repr(modes)}"
        )
    pipeline = data.get("pipeline")
    if not isinstance(pipeline, dict):
        pipeline = {}
    chosen = mode or pipeline.get("mode") or "sync"
    if chosen not in MODES:
        raise ConfigError(f"mode: must be one of {', '.join(MODES)}, got {short_repr(chosen)}")
    data = _deep_merge(data, modes.get(chosen, {}))
    data.setdefault("pipeline", {})
    if isinstance(data["pipeline"], dict):
        data["pipeline"]["mode"] = chosen
    return data


def load_config(
    path: str | os.PathLike[str], overrides: list[str] | None = None, mode: str | None = None
) -> RunConfig:
    """Load and validate a YAML run config, with optional `dotted.key=value` overrides.
    `mode` (sync or async) selects the file's `modes:` block (see `apply_mode`).
    Every way the file can be wrong (missing, a directory, over 1 MiB, not UTF-8, NUL bytes,
    bad YAML, nested too deeply, not a mapping) is a one-line `ConfigError` naming the file."""
    data = read_config_file(path)
    data = apply_mode(data, mode)
    if overrides:
        data = apply_overrides(data, overrides)
    return parse_config(data)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML config file's top-level mapping, not yet validated; each way the file can be wrong
    is a one-line `ConfigError` naming it (see `load_config`)."""
    p = Path(path)
    what = kind_problem(p)
    if what == "does not exist":
        raise ConfigError(f"config file not found: {p}")
    try:
        if what:
            raise FileProblem(f"{what}; expected a YAML run config")
        text = decode_text(read_bytes_capped(p, MAX_CONFIG_BYTES))
    except FileProblem as problem:
        raise ConfigError(f"config file {p} {problem}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {p} is not valid YAML: {yaml_problem(err)}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} is nested too deeply to be a run config") from None
    try:
        return _as_mapping(data)
    except ConfigError as err:
        raise ConfigError(f"config file {p}: {err}") from None


def config_to_json(cfg: RunConfig) -> str:
    """The resolved config as compact JSON: how it travels into pipeline tasks."""
    return cfg.model_dump_json()


def config_from_json(text: str) -> RunConfig:
    return parse_config(json.loads(text))


def flatten(cfg: RunConfig) -> dict[str, str]:
    """Dotted key -> value string, for MLflow params."""
    out: dict[str, str] = {}

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = "" if obj is None else str(obj)

    walk("", cfg.model_dump(mode="json"))
    return out
