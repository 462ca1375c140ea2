"""The trained policy in MLflow's model registry, and warm starts from a registered version.

Design, details and limitations: docs/async.md#moerlregistrypolicypy.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from moerl import tracking
from moerl.config import config_to_json
from moerl.errors import ConfigError
from moerl.store.runs import run_store

TAG_VERSION_URI = "moerl.version_uri"
TAG_MANIFEST = "moerl.manifest_sha256"
TAG_REWARD = "moerl.final_reward"
TAG_CONFIG_HASH = "moerl.config_hash"
TAG_RUN = "moerl.run_id"
# what moerl.config.WARM_START_PATTERN admits
REF = re.compile(
    r"^registry:(?P<name>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})(?:@(?P<alias>[A-Za-z0-9_-]{1,64})"
    r"|/(?P<version>[0-9]{1,9}))$"
)
_IN_STORE = re.compile(r"^(?P<root>.+)/runs/(?P<run_id>[^/]+)/versions/v(?P<version>\d{6,})$")


def parse_ref(ref: str) -> tuple[str, str | None, str | None]:
    """(name, alias, version) of `registry:<name>@<alias>` or `registry:<name>/<version>`."""
    m = REF.match(ref)
    if not m:
        raise ConfigError(
            f"model.warm_start: {ref!r} is not none, previous, registry:<name>@<alias> or "
            "registry:<name>/<version>"
        )
    return m.group("name"), m.group("alias"), m.group("version")


@dataclass(frozen=True)
class RegisteredPolicy:
    name: str
    registry_version: str
    version_uri: str  # <checkpoint root>/runs/<run id>/versions/vNNNNNN
    manifest_sha256: str
    run_id: str

    def _in_store(self) -> re.Match[str]:
        m = _IN_STORE.match(self.version_uri)
        if m is None:
            raise ConfigError(
                f"registry:{self.name}/{self.registry_version}: its version URI "
                f"{self.version_uri!r} is not <root>/runs/<run id>/versions/vNNNNNN"
            )
        return m

    @property
    def store_root(self) -> str:
        return self._in_store().group("root")

    @property
    def store_run_id(self) -> str:
        return self._in_store().group("run_id")

    @property
    def store_version(self) -> int:
        return int(self._in_store().group("version"))


def config_hash(config_json: str) -> str:
    return hashlib.sha256(config_json.encode()).hexdigest()


def register_final(cfg, run_id: str, final_uri: str) -> str | None:
    """At the end of a GRPO run with `tracking.registry_name`: register its final version (whose
    manifest is read back from the store). Returns the registry version, None when not asked."""
    if cfg.pipeline.kind != "grpo" or not cfg.tracking.registry_name:
        return None
    m = _IN_STORE.match(final_uri)
    if not m:
        raise ConfigError(
            f"tracking.registry_name: the final checkpoint {final_uri!r} is not a version in a store"
        )
    manifest = run_store(cfg.checkpoint, m.group("run_id")).manifest(int(m.group("version")))
    version = register_policy(
        tracking.resolve_uri(cfg.tracking),
        cfg.tracking.registry_name,
        run_id,
        final_uri,
        manifest.to_json(),
        manifest.sha256(),
        config_to_json(cfg),
    )
    print(
        f"[moerl] registered the final version {final_uri} as {cfg.tracking.registry_name}/{version} in MLflow's "
        "model registry",
        flush=True,
    )
    return version


def register_policy(
    tracking_uri: str,
    name: str,
    run_id: str,
    version_uri: str,
    manifest_json: str,
    manifest_sha256: str,
    config_json: str,
) -> str:
    """Register the run's final version as a new version of `name`; returns the registry version."""
    if not _IN_STORE.match(version_uri):
        raise ConfigError(
            f"tracking.registry_name: {version_uri!r} is not a version in a checkpoint store"
        )
    reward = tracking._client(tracking_uri).get_run(run_id).data.metrics.get("reward/mean")
    version = tracking.register_model_version(
        tracking_uri,
        name,
        "moerl policy (GRPO on an MoE model)",
        run_id,
        version_uri,
        manifest_json,
        "policy",
        {
            TAG_VERSION_URI: version_uri,
            TAG_MANIFEST: manifest_sha256,
            TAG_CONFIG_HASH: config_hash(config_json),
            TAG_RUN: run_id,
            TAG_REWARD: "" if reward is None else f"{reward:.6f}",
        },
    )
    tracking.set_tags(tracking_uri, run_id, {"moerl.registered_policy": f"{name}/{version}"})
    return version


def resolve_policy(tracking_uri: str, ref: str) -> RegisteredPolicy:
    """The registered version `ref` names; ConfigError naming `model.warm_start` if none."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name, alias, version = parse_ref(ref)
    client = MlflowClient(tracking_uri)
    try:
        if alias:
            mv = client.get_model_version_by_alias(name, alias)
        else:
            assert version is not None  # REF matches an alias or a version
            mv = client.get_model_version(name, version)
    except MlflowException as err:
        hint = (
            f"set the alias on a version in the MLflow UI (Models > {name} > a version > Aliases: {alias})"
            if alias
            else "name an existing version"
        )
        raise ConfigError(
            f"model.warm_start: {ref} is not in the model registry at {tracking_uri} "
            f"({str(err).splitlines()[0][:200]}); {hint}"
        ) from None
    tags = mv.tags or {}
    missing = [t for t in (TAG_VERSION_URI, TAG_MANIFEST) if t not in tags]
    if missing or not _IN_STORE.match(tags.get(TAG_VERSION_URI, "")):
        raise ConfigError(
            f"model.warm_start: {name}/{mv.version} was not registered by moerl (no usable "
            f"{', '.join(missing) or TAG_VERSION_URI} tag); register policies with tracking.registry_name"
        )
    return RegisteredPolicy(
        name=name,
        registry_version=str(mv.version),
        version_uri=tags[TAG_VERSION_URI],
        manifest_sha256=tags[TAG_MANIFEST],
        run_id=tags.get(TAG_RUN, mv.run_id or ""),
    )
