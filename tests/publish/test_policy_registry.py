"""The trained policy in MLflow's model registry (moerl/registry/policy.py):
a finished run's final version registered with the tags that find and check it, a warm start
from `registry:<name>@champion` verified against the registered manifest, a missing alias
refused at preflight naming the key, and `moerl schedule`'s default. Real parts: MLflow on a
SQLite file, a local-folder checkpoint store, the tiny MoE."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from moerl import tracking
from moerl.config import config_to_json, parse_config
from moerl.errors import CheckpointError, ConfigError
from moerl.registry.policy import (
    TAG_CONFIG_HASH,
    TAG_MANIFEST,
    TAG_REWARD,
    TAG_RUN,
    TAG_VERSION_URI,
    config_hash,
    register_final,
    resolve_policy,
)
from moerl.store.runs import run_store, version_uri


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.iterdir())
        if p.is_file() and p.suffix in (".safetensors", ".json")
    }


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from moerl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("registry")
    model = build_tiny_model(
        parse_config({"model": {"tiny": {"seed": 5}}}).model.tiny, root / "trained"
    )
    return {"root": root, "uri": f"sqlite:///{root / 'mlflow.db'}", "model": model}


def _cfg(env, **model):
    return parse_config(
        {
            "model": model,
            "tracking": {"uri": env["uri"], "experiment": "reg", "registry_name": "moerl-policy"},
            "checkpoint": {"uri": str(env["root"] / "ck"), "cache_dir": str(env["root"] / "cache")},
        }
    )


@pytest.fixture(scope="module")
def registered(env, tmp_path_factory):
    """A run that published versions 0 and 1, logged a reward, and finished: registered."""
    cfg = _cfg(env)
    run_id = tracking.start_run(cfg, env["uri"], {})
    store = run_store(cfg.checkpoint, run_id)
    store.publish(0, env["model"])
    v1 = tmp_path_factory.mktemp("v1") / "v1"
    shutil.copytree(env["model"], v1)
    store.publish(1, v1)
    tracking.log_metrics(env["uri"], run_id, 0, {"reward/mean": 0.25})
    tracking.log_metrics(env["uri"], run_id, 1, {"reward/mean": 0.75})
    final = version_uri(store, 1)
    version = register_final(cfg, run_id, final)
    tracking.finish_run(env["uri"], run_id, final, tmp_path_factory.mktemp("work"))
    return cfg, run_id, store, version


def test_the_final_version_is_registered_with_its_lineage(env, registered):
    from mlflow.tracking import MlflowClient

    cfg, run_id, store, version = registered
    client = MlflowClient(env["uri"])
    mv = client.get_model_version("moerl-policy", version)
    assert mv.tags[TAG_VERSION_URI] == version_uri(store, 1)
    assert mv.tags[TAG_MANIFEST] == store.manifest(1).sha256()
    assert float(mv.tags[TAG_REWARD]) == pytest.approx(0.75)  # the run's last reward/mean
    assert (
        mv.tags[TAG_CONFIG_HASH] == config_hash(config_to_json(cfg)) and mv.tags[TAG_RUN] == run_id
    )
    # a local store: the manifest logged there
    assert mv.source == f"runs:/{run_id}/policy" and mv.run_id == run_id
    assert client.get_run(run_id).data.tags["moerl.registered_policy"] == f"moerl-policy/{version}"
    # without tracking.registry_name nothing is registered
    plain = cfg.model_copy(
        update={"tracking": cfg.tracking.model_copy(update={"registry_name": None})}
    )
    assert register_final(plain, run_id, version_uri(store, 1)) is None


def test_a_warm_start_from_the_champion_lays_out_the_registered_version(env, registered, tmp_path):
    from mlflow.tracking import MlflowClient

    from moerl.components.publish_checkpoint.stage import prepare_initial

    _, run_id, store, version = registered
    MlflowClient(env["uri"]).set_registered_model_alias("moerl-policy", "champion", version)
    cfg = _cfg(env, warm_start="registry:moerl-policy@champion")
    reg = resolve_policy(env["uri"], cfg.model.warm_start)
    assert (reg.registry_version, reg.store_run_id, reg.store_version) == (version, run_id, 1)
    current = tracking.start_run(cfg, env["uri"], {})
    out = prepare_initial(cfg, tmp_path / "v0", run_id=current)
    assert _hashes(out) == _hashes(env["model"]) and not (out / "trainer").exists()
    tags = MlflowClient(env["uri"]).get_run(current).data.tags
    assert tags["moerl.warm_start.registered"] == f"moerl-policy/{version}"
    assert tags["moerl.warm_start.checkpoint"] == version_uri(store, 1)
    # by number too
    again = prepare_initial(
        _cfg(env, warm_start=f"registry:moerl-policy/{version}"), tmp_path / "again", current
    )
    assert _hashes(again) == _hashes(out)


def test_a_version_changed_after_registration_is_refused(env, registered, tmp_path, monkeypatch):
    from moerl.components.publish_checkpoint.stage import prepare_initial
    from moerl.registry import policy as reg_mod

    _, _, _, version = registered
    real = reg_mod.resolve_policy

    def tampered(uri, ref):  # the registry says another manifest than the store holds
        r = real(uri, ref)
        return r.__class__(**{**r.__dict__, "manifest_sha256": "0" * 64})

    monkeypatch.setattr(reg_mod, "resolve_policy", tampered)
    with pytest.raises(CheckpointError, match="changed after it was registered"):
        prepare_initial(_cfg(env, warm_start=f"registry:moerl-policy/{version}"), tmp_path / "x")


def test_a_missing_alias_or_name_is_refused_at_preflight_naming_the_key(env, registered):
    from moerl.preflight import preflight

    with pytest.raises(
        ConfigError,
        match=r"model.warm_start: registry:moerl-policy@staging is not in the model "
        r"registry.*Aliases: staging",
    ):
        preflight(_cfg(env, warm_start="registry:moerl-policy@staging"))
    with pytest.raises(
        ConfigError, match="model.warm_start: registry:nobody@champion is not in the model registry"
    ):
        preflight(_cfg(env, warm_start="registry:nobody@champion"))
    with pytest.raises(ConfigError, match="model.warm_start"):
        parse_config({"model": {"warm_start": "registry:bad name@x"}})


def test_scheduled_runs_start_from_the_champion_when_the_config_registers():
    from moerl.orchestrate.schedule import scheduled_config

    base = parse_config({})
    assert scheduled_config(base).model.warm_start == "previous"
    reg = parse_config({"tracking": {"registry_name": "moerl-policy"}})
    assert scheduled_config(reg).model.warm_start == "registry:moerl-policy@champion"
    named = parse_config(
        {"tracking": {"registry_name": "p"}, "model": {"warm_start": "registry:p/3"}}
    )
    assert scheduled_config(named).model.warm_start == "registry:p/3"


def test_the_runs_dataset_is_an_mlflow_dataset_input(env, registered):
    import hashlib

    from mlflow.tracking import MlflowClient

    from moerl.tasks.dataset import resolve_path

    _, run_id, _, _ = registered
    (inp,) = MlflowClient(env["uri"]).get_run(run_id).inputs.dataset_inputs
    data = resolve_path("builtin:digits-copy").read_bytes()
    assert inp.dataset.name == "digits-copy" and inp.dataset.source_type == "moerl-builtin"
    assert inp.dataset.digest == hashlib.sha256(data).hexdigest()[:16]
    rows = data.count(b"\n")
    assert f'"rows": {rows}' in inp.dataset.profile
    assert [(t.key, t.value) for t in inp.tags] == [("mlflow.data.context", "training")]
