"""The run config: one YAML file, one pydantic model per section, composed into `RunConfig`.

Every field the code reads is declared in this package with its description (the docstring
under it), unknown keys are rejected, and `load_config` turns a validation failure into a
one-line `ConfigError` naming the dotted key (exit code 2 in the CLI). One module per concern:
`model`, `task` (task, sandbox, reward, reward-model training), `rollout`, `buffer` (buffer,
work units, Valkey), `trainer`, `checkpoint` (store, cache tier), `cluster` (the EKS target),
`run` (tracking, pipeline, require, `RunConfig`), `load` (files, overrides, modes, JSON,
errors) and `docs`, which generates docs/config.md (`moerl config docs`). Import the names
from `moerl.config`; cross-checks against the machine happen when the stage that needs them
starts (docs/configuration.md).
"""

from moerl.config.buffer import BufferConfig, UnitsConfig, ValkeyConfig
from moerl.config.checkpoint import MAX_CHUNK_MB, CacheTierConfig, CheckpointConfig
from moerl.config.cluster import (
    ClusterConfig,
    GroupConfig,
    GroupsConfig,
    LaunchConfig,
    Toleration,
)
from moerl.config.load import (
    MAX_CONFIG_BYTES,
    MODES,
    apply_mode,
    apply_overrides,
    config_from_json,
    config_to_json,
    flatten,
    load_config,
    parse_config,
)
from moerl.config.model import WARM_START_PATTERN, ModelConfig, TinyMoeConfig
from moerl.config.rollout import RolloutConfig
from moerl.config.run import PipelineConfig, RequireConfig, RunConfig, TrackingConfig
from moerl.config.task import (
    RewardConfig,
    RewardModelRef,
    RewardModelTrainConfig,
    SandboxConfig,
    TaskConfig,
)
from moerl.config.trainer import TrainerConfig

__all__ = [
    "MAX_CHUNK_MB",
    "MAX_CONFIG_BYTES",
    "MODES",
    "WARM_START_PATTERN",
    "BufferConfig",
    "CacheTierConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "GroupConfig",
    "GroupsConfig",
    "LaunchConfig",
    "ModelConfig",
    "PipelineConfig",
    "RequireConfig",
    "RewardConfig",
    "RewardModelRef",
    "RewardModelTrainConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "TaskConfig",
    "TinyMoeConfig",
    "Toleration",
    "TrackingConfig",
    "TrainerConfig",
    "UnitsConfig",
    "ValkeyConfig",
    "apply_mode",
    "apply_overrides",
    "config_from_json",
    "config_to_json",
    "flatten",
    "load_config",
    "parse_config",
]
