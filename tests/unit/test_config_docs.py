"""The run config documents itself: every field of every section carries a description in the
models, docs/config.md is exactly what the models generate, and the KFP run form describes its
fields with the models' own text. Pure: no servers, no files but docs/config.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from moerl.config import RunConfig, parse_config
from moerl.config.docs import field_description, fields, render_markdown, sections
from moerl.models.policy import SUPPORTED_MODEL_TYPES
from moerl.pipelines.params import PARAMS, REWARD_MODEL, docstring, params_for

ROOT = Path(__file__).resolve().parents[2]


def test_the_walk_reaches_every_section_of_run_config():
    paths = {p for p, _ in sections()}
    # nested sections, one behind an optional and one inside a list, are walked too
    for want in ("model.tiny", "reward.model", "reward.sandbox", "checkpoint.cache_tier"):
        assert want in paths, want
    assert "cluster.groups.trainer.tolerations[]" in paths
    assert len(list(fields())) > 227


def test_every_field_of_every_section_has_a_description():
    missing = [key for key, field in fields() if not (field.description or "").strip()]
    assert missing == []


def test_every_section_has_a_docstring():
    bare = [f"{p or '(top)'}: {m.__name__}" for p, m in sections() if not (m.__doc__ or "").strip()]
    assert bare == []


def test_docs_config_md_is_what_the_models_generate():
    path = ROOT / "docs" / "config.md"
    assert path.read_text(encoding="utf-8") == render_markdown(), (
        "docs/config.md is stale: run `moerl config docs`"
    )


def test_the_reference_lists_every_key_with_its_default_and_description():
    text = render_markdown()
    rows = {
        line.split("|")[1].strip().strip("`"): line
        for line in text.splitlines()
        if line.startswith("| `")
    }
    for key, _ in fields():
        assert key in rows, key
    assert "`8`" in rows["rollout.samples_per_prompt"]
    assert "required" in rows["reward.model.registered"]
    # a `|` inside a type or regex is escaped, so no row has more than its four cells
    assert all(line.replace("\\|", "").count("|") == 5 for line in rows.values())


def test_config_docs_check_names_the_stale_file(tmp_path):
    stale = tmp_path / "config.md"
    stale.write_text(render_markdown() + "drift\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "moerl.cli", "config", "docs", "--check", "-o", str(stale)]
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 1 and str(stale) in run.stderr and "stale" in run.stderr
    run = subprocess.run(
        cmd[:-3] + ["-o", str(stale)], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert run.returncode == 0 and stale.read_text(encoding="utf-8") == render_markdown()
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("kind", ["grpo", REWARD_MODEL])
def test_the_run_form_describes_its_fields_with_the_models_text(kind):
    cfg = parse_config({"pipeline": {"kind": kind, "mode": "async" if kind == "grpo" else "sync"}})
    form = params_for(cfg)
    assert form
    doc = docstring("summary", {}, cfg)
    for p in form:
        key = p.key(kind)
        assert key is not None
        want = field_description(key)
        assert want and p.describe(kind).startswith(want), p.name
        assert f"    {p.name}: {p.describe(kind)}" in doc.splitlines()


def test_every_run_param_key_is_a_config_key():
    keys = {key for key, _ in fields()}
    for p in PARAMS:
        for key in (p.grpo_key, p.rm_key):
            assert key is None or key in keys, (p.name, key)


def test_model_families_agree_between_the_config_the_loader_and_the_form():
    arch = get_args(
        RunConfig.model_fields["model"]
        .annotation.model_fields["tiny"]
        .annotation.model_fields["architecture"]
        .annotation
    )
    assert set(arch) == set(SUPPORTED_MODEL_TYPES)
    described = field_description("model.path")
    for family in SUPPORTED_MODEL_TYPES:
        assert family in described, family
    model = next(p for p in PARAMS if p.name == "model")
    assert all(family in model.describe("grpo") for family in SUPPORTED_MODEL_TYPES)
