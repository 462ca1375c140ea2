"""Where policy versions are published: the durable store and the cache tier in front of it."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from moerl.config.base import _Section


class CacheTierConfig(_Section):
    """The checkpoint cache tier: an S3 endpoint on the memory-optimized (`buffer`) nodes that
    makes a version servable before the durable store has it (docs/weights.md).

    `uri` unset: no cache tier, versions go straight to `checkpoint.uri`. `endpoint_url:
    embedded`: a local run (`moerl run`) starts its own server (`weed mini` on 127.0.0.1) for the
    run and stops it after. Credentials: `<credentials_env>_ACCESS_KEY_ID` and
    `<credentials_env>_SECRET_ACCESS_KEY` from the environment (on EKS from the Secret
    `moerl-ckpt-cache`); when unset, the standard AWS chain."""

    uri: str | None = None
    """s3://bucket/prefix on the cache server; null: no cache tier."""
    endpoint_url: str | None = None
    """The cache server's S3 URL, or `embedded` for a local run's own server; required with `uri`."""
    region: str = "us-east-1"
    """The S3 region the client signs for."""
    keep_last: int = Field(2, ge=1)
    """Versions the cache tier keeps (plus `latest`); older ones are read from the durable store."""
    credentials_env: str = Field("MOERL_CACHE_TIER", pattern=r"^[A-Z][A-Z0-9_]*$")
    """Prefix of the environment variables holding the cache tier's credentials
    (<prefix>_ACCESS_KEY_ID, <prefix>_SECRET_ACCESS_KEY)."""
    max_attempts: int = Field(2, ge=1, le=10)
    """S3 attempts before a reader falls back to the durable store: a dead cache tier costs
    seconds, not minutes."""
    capacity_gb: float = Field(48.0, gt=0.0)
    """GiB the cache server holds; a version that does not fit keep_last + 1 times goes to the
    durable store first. Keep it equal to the server's volume (manifests/base/ckpt-cache.yaml)."""

    @field_validator("uri")
    @classmethod
    def _s3_only(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("s3://") or len(v.rstrip("/")) <= len("s3://")):
            raise ValueError(f"must be s3://bucket/prefix on the cache server, got {v!r}")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        if v and v != "embedded" and "@" in v.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; set them in the environment (credentials_env)"
            )
        return v

    @model_validator(mode="after")
    def _needs_endpoint(self) -> CacheTierConfig:
        if self.uri is not None and not self.endpoint_url:
            raise ValueError(
                "checkpoint.cache_tier.endpoint_url is required with a cache tier uri "
                "(the cache server's URL, or 'embedded' for a local run)"
            )
        return self


MAX_CHUNK_MB = 256  # checkpoint.chunk_mb's ceiling


class CheckpointConfig(_Section):
    """Where policy versions are published: a local folder or `s3://bucket/prefix`."""

    uri: str = "checkpoints"
    """Where versions are published: a local folder or s3://bucket/prefix; each run under
    <uri>/runs/<run id>/."""
    endpoint_url: str | None = None
    """For S3-compatible stores, without credentials (they come from the AWS chain)."""
    region: str | None = None
    """The S3 region; null: the AWS chain's."""
    cache_dir: str = ".moerl/cache"
    """The node-local folder verified copies of versions are fetched into; a relative path is
    resolved against each process's working directory (a pod's own)."""
    cache_keep: int = Field(2, ge=1)
    """The node-local fetch cache keeps the newest this-many versions of a run (and any being
    served); older verified copies are deleted after each fetch."""
    pin_ttl_s: float = Field(3600.0, gt=0.0)
    """A serving pin is a lease: one not renewed within this many seconds no longer protects its
    version from retention."""
    multipart_chunk_mb: int = Field(8, ge=5)
    """S3 multipart part size in MiB."""
    max_concurrency: int = Field(8, ge=1, le=64)
    """Parallel S3 transfers of one file at most."""
    keep_last: int = Field(3, ge=1)
    """Retention after each publish keeps the newest this-many versions (never deleting latest,
    version 0, or a version pinned by a live run)."""
    keep_every: int = Field(0, ge=0)
    """Retention also keeps every this-many-th version; 0: none."""
    max_attempts: int = Field(5, ge=1, le=20)
    """Retries with exponential backoff of an S3 call before a CheckpointError."""
    claim_ttl_s: float = Field(3600.0, gt=0.0)
    """A publisher's claim on a version lapses after this many seconds; it must outlast the longest
    publish of one version and dwarf the machines' clock skew."""
    cache_tier: CacheTierConfig = CacheTierConfig()
    """The cache tier in front of `uri` (none by default; docs/weights.md)."""
    state_every: int | None = Field(None, ge=1, le=1000)
    """Async trainer: the trainer's state (float32 master weights and Adam, per-rank
    Distributed Checkpoints under trainer/) goes with every this-many-th version and the run's
    last; the others carry engine weights and counters only. A retry resumes from the newest
    durable version with state; the versions after it stay published and their groups consumed,
    but their updates are lost (at most state_every - 1 versions of training). null: 1 on one
    trainer node, else keep_last capped at 4 (the state is 6x the engine weights: its cost in
    docs/bench-reports/project.md). The sync pipeline saves it with every version."""
    max_unpublished: int = Field(1, ge=1, le=8)
    """Async trainer: versions handed to the publisher and not yet durable; the trainer trains on
    meanwhile and stalls (weights/trainer_stall_s) only when this many are in flight."""
    outage_s: float = Field(600.0, ge=0.0, le=7200.0)
    """Async trainer: how long its publisher, and a restarted trainer's recovery, retry a store
    that cannot be reached or answers server errors (an S3 brownout), with backoff, before the
    run fails; meanwhile max_unpublished holds the trainer back. 0: fail at the first."""
    chunk_mb: int = 64
    """Every file's sha256 per chunk of this many MiB goes into the manifest, so a copy can be
    assembled and checked chunk by chunk from peers (fanout)."""
    fanout: bool = False
    """Async mode: rollout engines of one run fetch a new version from each other (verified chunks,
    coordinated through Valkey) before the cache tier and S3."""

    @field_validator("uri")
    @classmethod
    def _uri(cls, v: str) -> str:
        if "://" in v and not v.startswith("s3://"):
            raise ValueError(f"must be a local path or s3://bucket/prefix, got {v!r}")
        if v.startswith("s3://") and len(v) <= len("s3://"):
            raise ValueError("s3:// URI needs a bucket: s3://bucket/prefix")
        return v

    @field_validator("chunk_mb")
    @classmethod
    def _chunk_mb(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHUNK_MB:
            raise ValueError(f"allowed: 1 to {MAX_CHUNK_MB} (MiB), got {v}")
        return v

    @field_validator("endpoint_url")
    @classmethod
    def _no_credentials_in_url(cls, v: str | None) -> str | None:
        if v and "@" in v.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "must not embed credentials; use the AWS credential chain (env, profile, IRSA)"
            )
        return v
