"""The shared base of every run-config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    """A config section: unknown keys rejected, immutable once validated, and every field
    described by the docstring under it (what `moerl config docs` and the KFP run form show)."""

    # no inf/nan anywhere: `.inf` in YAML would pass `ge=` bounds and poison a run silently
    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )
