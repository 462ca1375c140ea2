"""docs/config.md, generated from the models: every section, every key with its type, default
and description (the docstring under each field).

`moerl config docs` writes it and `moerl config docs --check` fails when the file differs from
what the models say, so the reference cannot drift from the code. `field_description` is what
the KFP run form (pipelines/params.py) takes its descriptions from.
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from moerl.config.run import RunConfig

DOC_PATH = "docs/config.md"

_HEADER = """\
# Run config reference

<!-- Generated from moerl/config/ by `moerl config docs`; do not edit by hand.
     `moerl config docs --check` (and tests/unit/test_config_docs.py) fail when it is stale. -->

Every key of the run config, section by section: its type (with the bounds the config
enforces), its default and what it does. How to write and override a config, and notes on
selected keys: [configuration.md](configuration.md). Besides these sections a file may hold a
`modes:` block, `{sync: {...}, async: {...}}`, merged over the rest for the selected mode.
A nested section is listed after its parent; `null` is YAML's empty value.
"""


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds: itself, `X | None`, `list[X]`, `dict[str, X]`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in get_args(annotation):
        out.extend(_models_in(arg))
    return out


def sections(
    model: type[BaseModel] = RunConfig, path: str = ""
) -> Iterator[tuple[str, type[BaseModel]]]:
    """(dotted key path, model) of `model` and every section below it, parents first; the
    items of a list of sections are `<key>[]`."""
    yield path, model
    for name, field in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        for sub in _models_in(field.annotation):
            suffix = "[]" if get_origin(field.annotation) is list else ""
            yield from sections(sub, key + suffix)


def fields(model: type[BaseModel] = RunConfig, path: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) of every field of every section below `model`."""
    for section_path, section in sections(model, path):
        for name, field in section.model_fields.items():
            yield (f"{section_path}.{name}" if section_path else name), field


def field_info(key: str) -> FieldInfo:
    """The field a dotted config key names, e.g. `reward.model.registered`."""
    model: type[BaseModel] = RunConfig
    *parents, leaf = key.split(".")
    for part in parents:
        subs = _models_in(model.model_fields[part].annotation)
        if not subs:
            raise KeyError(f"{key}: {part} is not a section")
        model = subs[0]
    return model.model_fields[leaf]


def field_description(key: str) -> str:
    """A dotted config key's description, on one line."""
    return " ".join((field_info(key).description or "").split())


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = get_origin(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(annotation))
    if origin in (list, dict):
        inner = ", ".join(_type_name(a) for a in get_args(annotation))
        return f"{origin.__name__}[{inner}]"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
)


def _type(field: FieldInfo) -> str:
    parts = [_type_name(field.annotation)]
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            parts.append(f"matching `{pattern}`")
        min_length = getattr(meta, "min_length", None)
        if min_length:
            parts.append(f"at least {min_length} long")
    return ", ".join(parts)


def _default(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    """One table cell: on one line, `|` escaped, and a `<` that opens a tag-like word outside
    code spans as an entity (a bare `<name>` would be taken for an HTML tag and vanish)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", parts[i])
    return "`".join(parts)


def _anchor(path: str) -> str:
    return "".join(c for c in path.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def render_markdown() -> str:
    """The whole of docs/config.md."""
    out = [_HEADER]
    for path, model in sections():
        title = path or "(top level)"
        out.append(f"## {title}\n")
        doc = " ".join(inspect.cleandoc(model.__doc__ or "").split())
        out.append(f"`{model.__name__}`: {_cell(doc)}\n")
        out.append("| key | type | default | description |")
        out.append("| --- | --- | --- | --- |")
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            desc = field.description or ""
            if _models_in(field.annotation):
                sub = key + ("[]" if get_origin(field.annotation) is list else "")
                desc += f" See [{sub}](#{_anchor(sub)})."
            out.append(
                f"| `{key}` | {_cell(_type(field))} | {_cell(_default(field))} | {_cell(desc)} |"
            )
        out.append("")
    return "\n".join(out)


def stale(path: str | Path = DOC_PATH) -> bool:
    """Whether the file at `path` differs from `render_markdown()` (a missing file is stale)."""
    p = Path(path)
    return not p.is_file() or p.read_text(encoding="utf-8") != render_markdown()


def write(path: str | Path = DOC_PATH) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render_markdown(), encoding="utf-8")
    return p
