"""Where a reward model lives, and how a GRPO run finds it.

Design, details and limitations: docs/async.md#moerlregistryreward_modelpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moerl import tracking
from moerl.config import CheckpointConfig, RewardModelRef
from moerl.errors import CheckpointError, ConfigError
from moerl.store.runs import open_store

TAG_STORE = "moerl.store_uri"
TAG_STORE_VERSION = "moerl.store_version"
TAG_MANIFEST = "moerl.manifest_sha256"
TAG_ACCURACY = "moerl.eval_accuracy"


@dataclass(frozen=True)
class RegisteredRewardModel:
    name: str
    registry_version: str
    source: str | None  # the registry's source (see the module docstring); MLflow's may be unset
    store_uri: str  # the lineage it was published in: <checkpoint.uri>/runs/<rm run id>
    store_version: int
    manifest_sha256: str
    rm_run_id: str
    eval_accuracy: str

    @property
    def uri(self) -> str:
        """The version's URI in the checkpoint store."""
        return f"{self.store_uri.rstrip('/')}/versions/v{self.store_version:06d}"

    def lineage_tags(self) -> dict[str, str]:
        return {
            "reward_model.registered": f"{self.name}/{self.registry_version}",
            "reward_model.uri": self.uri,
            "reward_model.version": str(self.store_version),
            "reward_model.manifest_sha256": self.manifest_sha256,
            "reward_model.run_id": self.rm_run_id,
            "reward_model.eval_accuracy": self.eval_accuracy,
        }


def register(
    tracking_uri: str,
    name: str,
    version_uri: str,
    rm_run_id: str,
    store_uri: str,
    store_version: int,
    manifest_json: str,
    manifest_sha256: str,
    accuracy: float,
) -> str:
    """Register the published version as a new version of `name`; returns the registry version."""
    return tracking.register_model_version(
        tracking_uri,
        name,
        "moerl reward model (Bradley-Terry on preference pairs)",
        rm_run_id,
        version_uri,
        manifest_json,
        "reward_model",
        {
            TAG_STORE: store_uri,
            TAG_STORE_VERSION: str(store_version),
            TAG_MANIFEST: manifest_sha256,
            TAG_ACCURACY: f"{accuracy:.4f}",
        },
    )


def resolve(tracking_uri: str, ref: RewardModelRef) -> RegisteredRewardModel:
    """The registered version `ref.registered` names; ConfigError naming the key if there is none."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    name, version = ref.registered.split("/")
    client = MlflowClient(tracking_uri)
    try:
        if version == "latest":
            found = client.search_model_versions(
                f"name='{name}'", order_by=["version_number DESC"], max_results=1
            )
            if not found:
                raise ConfigError(
                    f"reward.model.registered: no registered model {name!r} at {tracking_uri}; train "
                    f"one with `moerl run configs/tiny-rm.yaml` (reward_model.registry_name)"
                )
            mv = found[0]
        else:
            mv = client.get_model_version(name, version)
    except MlflowException as err:
        raise ConfigError(
            f"reward.model.registered: {ref.registered} is not in the model registry at "
            f"{tracking_uri} ({str(err).splitlines()[0][:200]})"
        ) from None
    tags = mv.tags or {}
    missing = [t for t in (TAG_STORE, TAG_STORE_VERSION, TAG_MANIFEST) if t not in tags]
    if missing:
        raise ConfigError(
            f"reward.model.registered: {name}/{mv.version} was not registered by moerl "
            f"(no {', '.join(missing)} tag); register reward models with `pipeline.kind: reward_model`"
        )
    return RegisteredRewardModel(
        name=name,
        registry_version=str(mv.version),
        source=mv.source,
        store_uri=tags[TAG_STORE],
        store_version=int(tags[TAG_STORE_VERSION]),
        manifest_sha256=tags[TAG_MANIFEST],
        rm_run_id=mv.run_id or "",
        eval_accuracy=tags.get(TAG_ACCURACY, ""),
    )


def fetch(ckpt: CheckpointConfig, rm: RegisteredRewardModel) -> Path:
    """The registered version in the node-local cache (`<cache_dir>/reward-models/<rm run>`),
    verified file by file against its manifest, whose hash must be the registered one."""
    store = open_store(ckpt.model_copy(update={"uri": rm.store_uri}))
    manifest = store.manifest(rm.store_version)
    if manifest.sha256() != rm.manifest_sha256:
        raise CheckpointError(
            f"reward model {rm.name}/{rm.registry_version}: the manifest in {rm.uri} has sha256 "
            f"{manifest.sha256()}, the registry recorded {rm.manifest_sha256}: the published "
            f"version changed after it was registered"
        )
    return store.fetch(
        rm.store_version, Path(ckpt.cache_dir) / "reward-models" / (rm.rm_run_id or rm.name)
    )
