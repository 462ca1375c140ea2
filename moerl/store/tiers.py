"""The tiers a policy version lives in: the node cache, the cache tier, the durable store.

Design, details and limitations: docs/weights.md#moerlstoretierspy.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.base import CheckpointStore, RemoteParts
from moerl.store.fence import new_owner
from moerl.store.folder import LocalStore
from moerl.store.manifest import MANIFEST, Manifest, version_dir
from moerl.store.nodecache import MARKER, is_verified, lock_path, shared

log = logging.getLogger(__name__)

Source = Literal["node", "peers", "cache", "durable"]


class Swarm(Protocol):
    """What `Tiers.fetch` asks of a fan-out (`moerl.store.fanout.Swarm`)."""

    def fetch(
        self,
        tiers: Tiers,
        version: int,
        dest: Path,
        exclude: tuple[str, ...],
        expect_sha256: str | None,
    ) -> tuple[Path, dict[str, int]]: ...  # the copy; chunks by source

    def offer(
        self, version: int, path: Path, manifest: Manifest, exclude: tuple[str, ...] = ()
    ) -> None: ...


# On a cluster the cache server's two identities come from one Secret (manifests/base/
# ckpt-cache.yaml): the stages that publish get the writer's keys, the ones that only read
# (engines, redistribution) the reader's, as `<credentials_env>_ACCESS_KEY_ID/_SECRET_ACCESS_KEY`.
# `start_run` reads too: its preflight checks the bucket (HeadBucket, which the reader's Read and
# List allow). `finish_run` writes: it deletes the finished run's prefix (`drop_cache_run`). The
# writer creates the bucket when a restarted server lost it (`S3Store.ensure_bucket`: its Admin). A stage left out of both gets no keys, so boto3 falls back to the pod's IRSA role,
# which the cache server refuses (403): every stage that touches the cache tier must be here.
# `moerl.launch.podsecrets.pod_secret_env` is where `place`, the launcher and the test sandbox read it.
CACHE_TIER_SECRET = "moerl-ckpt-cache"
WRITER_STAGES = frozenset({"init_policy", "policy_update", "async_trainer", "finish_run"})
READER_STAGES = frozenset({"start_run", "rollout", "rollout_worker", "redistribute_weights"})


def cache_tier_secret_env(cfg: CheckpointConfig, stage: str) -> dict[str, str]:
    """Environment variable -> key of the Secret `CACHE_TIER_SECRET`, for `stage`'s pod; empty
    without a cache tier or for a stage that never touches it."""
    if cfg.cache_tier.uri is None:
        return {}
    role = "WRITER" if stage in WRITER_STAGES else "READER" if stage in READER_STAGES else None
    if role is None:
        return {}
    env = cfg.cache_tier.credentials_env
    return {
        f"{env}_ACCESS_KEY_ID": f"{role}_ACCESS_KEY_ID",
        f"{env}_SECRET_ACCESS_KEY": f"{role}_SECRET_ACCESS_KEY",
    }


def cache_tier_credentials(cfg: CheckpointConfig) -> tuple[str, str] | None:
    """The cache tier's keys from `<credentials_env>_ACCESS_KEY_ID` / `_SECRET_ACCESS_KEY`, each
    from its file (`..._FILE`: a pod's Secret volume) or the variable (`moerl.secrets.read_secret`);
    None (the standard AWS chain) when neither is set."""
    from moerl.secrets import read_secret

    env = cfg.cache_tier.credentials_env
    key, secret = read_secret(f"{env}_ACCESS_KEY_ID"), read_secret(f"{env}_SECRET_ACCESS_KEY")
    if bool(key) != bool(secret):
        raise CheckpointError(
            f"checkpoint.cache_tier: only one of {env}_ACCESS_KEY_ID and {env}_SECRET_ACCESS_KEY "
            "is set; set both (the cache server's identity) or neither (the AWS chain)"
        )
    return (key, secret) if key and secret else None


def cache_tier_store(cfg: CheckpointConfig, run_id: str) -> CheckpointStore | None:
    """The run's lineage in the cache tier; None without one."""
    ct = cfg.cache_tier
    if ct.uri is None:
        return None
    if ct.endpoint_url == "embedded":
        raise CheckpointError(
            "checkpoint.cache_tier.endpoint_url is 'embedded', but no cache server was started for "
            "this process: `moerl run` starts one; elsewhere give the cache server's URL"
        )
    from moerl.store.s3 import S3Store  # boto3 only with a cache tier

    sub = cfg.model_copy(
        update={
            "uri": f"{ct.uri.rstrip('/')}/runs/{run_id}",
            "endpoint_url": ct.endpoint_url,
            "region": ct.region,
            "max_attempts": ct.max_attempts,
        }
    )
    store = S3Store(sub, credentials=cache_tier_credentials(cfg))
    store.pin_ttl_s, store.claim_ttl_s = cfg.pin_ttl_s, cfg.claim_ttl_s
    store.keep_version_zero = (
        False  # room for `keep_last` versions only (check_tier_fits); S3 has version 0
    )
    # engine weights only: the trainer's state (`trainer/`, ~6x the weights) goes to the durable
    # store alone; the manifest still lists it, so one sha256 names the version in both tiers
    store.absent = ENGINE_EXCLUDE
    return store


_GiB = 2**30

# what only the trainer reads (its master weights and optimizer state): never fetched by an
# engine, never stored in the cache tier (re-exported by `moerl.store.runs`)
ENGINE_EXCLUDE = ("trainer/",)


def held_bytes(src: Path, absent: tuple[str, ...] = ()) -> int:
    """The bytes of the files under `src` that a store lacking `absent` prefixes will hold."""
    src = Path(src)
    return sum(
        f.stat().st_size
        for f in src.rglob("*")
        if f.is_file() and not (absent and f.relative_to(src).as_posix().startswith(absent))
    )


def check_tier_fits(cfg: CheckpointConfig, version_bytes: int) -> None:
    """Refuse (CheckpointError) a version the cache tier has no room for. `version_bytes`: what
    the tier holds of it (engine weights, not `trainer/`: `held_bytes`). The tier holds
    `cache_tier.keep_last` versions and, while a new one is written, that one too (retention runs
    after the new version is complete), so `(keep_last + 1) x version_bytes` must fit in
    `cache_tier.capacity_gb` (GiB: the server's memory-backed volume, manifests/base/ckpt-cache.yaml).
    The publisher then publishes the version to the durable store first (counted)."""
    ct = cfg.cache_tier
    need, cap = (ct.keep_last + 1) * version_bytes, ct.capacity_gb * _GiB
    if need > cap:
        raise CheckpointError(
            f"checkpoint.cache_tier.capacity_gb is {ct.capacity_gb:g} GiB, but a version is "
            f"{version_bytes / _GiB:.3g} GiB ({version_bytes} bytes) and the cache tier holds keep_last + 1 = "
            f"{ct.keep_last + 1} of them while one is written ({need / _GiB:.3g} GiB): raise the cache server's volume (the overlays' "
            "ckpt-cache patch) and capacity_gb with it, or lower checkpoint.cache_tier.keep_last; until then "
            "versions go to the durable store first"
        )


def drop_cache_run(cfg: CheckpointConfig, run_id: str) -> int:
    """Delete a finished run's prefix from the cache tier (its versions, pointer, claims, pins);
    the durable store is not touched. Returns how many objects went; 0 without a cache tier."""
    store = cache_tier_store(cfg, run_id)
    if store is None:
        return 0
    keys = store._list("")
    # first: no half-deleted version is complete
    store._delete([k for k in keys if k.endswith("/manifest.json")])
    store._delete([k for k in keys if not k.endswith("/manifest.json")])
    log.info("deleted run %s's %d objects from the cache tier %s", run_id, len(keys), store.uri)
    return len(keys)


@dataclass
class Tiers:
    """One run's durable store and (optionally) its cache tier."""

    durable: CheckpointStore
    cache: CheckpointStore | None
    chunk_size: int
    retention: tuple[int, int]  # the durable store's (keep_last, keep_every)
    cache_keep: int
    cache_failed: str | None = None  # why the last servable publish skipped the cache tier
    config: CheckpointConfig | None = None  # for check_tier_fits (the cache tier's capacity)
    epoch: int | None = None  # the trainer's epoch: every write is fenced by it (moerl.store.fence)
    owner: str = field(default_factory=new_owner)
    cache_too_small: bool = (
        False  # the last servable publish skipped the cache tier for want of room
    )

    # -- writing --------------------------------------------------------------------------
    def publish_servable(
        self,
        version: int,
        src: Path,
        meta: dict[str, str],
        exclusive: bool = False,
        parts: RemoteParts | None = None,
    ) -> Manifest:
        """The first copy: the cache tier's (servable), or the durable store's without one. A
        cache tier that fails (down, full) is logged and counted by the caller
        (`cache_tier_failed`), and the version goes to the durable store first instead: it is
        servable once durable, later but never lost."""
        self.cache_failed, self.cache_too_small = None, False
        if self.cache is not None:
            try:
                # before a byte is written: a tier that cannot hold it is skipped
                if self.config is not None:
                    try:
                        # with the parts other writers put (an imported model's weights)
                        extra = getattr(parts, "nbytes", 0) if parts is not None else 0
                        check_tier_fits(self.config, held_bytes(src, self.cache.absent) + extra)
                    except CheckpointError:
                        self.cache_too_small = True
                        raise
                ensure = getattr(self.cache, "ensure_bucket", None)
                if ensure is not None:  # a restarted cache server lost its bucket (memory-backed)
                    ensure()
                return self.cache.publish(
                    version,
                    src,
                    meta,
                    retention=(self.cache_keep, 0),
                    exclusive=exclusive,
                    chunk_size=self.chunk_size,
                    epoch=self.epoch,
                    owner=self.owner,
                    parts=parts,
                )
            except CheckpointError as e:
                self.cache_failed = str(e)
                log.warning(
                    "version %d: the cache tier %s failed (%s); publishing it to the durable store %s "
                    "first (servable once durable)",
                    version,
                    self.cache.uri,
                    e,
                    self.durable.uri,
                )
        return self.durable.publish(
            version,
            src,
            meta,
            retention=self.retention,
            exclusive=exclusive,
            chunk_size=self.chunk_size,
            epoch=self.epoch,
            owner=self.owner,
            parts=parts,
        )

    def publish_durable(
        self,
        manifest: Manifest,
        src: Path,
        exclusive: bool = False,
        parts: RemoteParts | None = None,
    ) -> Manifest:
        """The durable copy under the same manifest; nothing to do when the first copy was the
        durable one (no cache tier, or the cache tier failed)."""
        if self.cache is None or self.cache_failed is not None:
            return manifest
        return self.durable.publish(
            manifest.version,
            src,
            retention=self.retention,
            exclusive=exclusive,
            manifest=manifest,
            epoch=self.epoch,
            owner=self.owner,
            parts=parts,
        )

    def publish(
        self, version: int, src: Path, meta: dict[str, str], exclusive: bool = False
    ) -> Manifest:
        return self.publish_durable(
            self.publish_servable(version, src, meta, exclusive), src, exclusive
        )

    # -- reading --------------------------------------------------------------------------
    def fetch(
        self,
        version: int,
        dest: Path,
        exclude: tuple[str, ...] = (),
        expect_sha256: str | None = None,
        swarm: Swarm | None = None,
    ) -> tuple[Path, Source]:
        """The nearest verified copy of `version` in `dest`, and where it came from.

        `expect_sha256`: the manifest the caller was told to serve (the registry's); a tier
        holding another manifest under that number is skipped, never served."""
        if expect_sha256 is not None:
            hit = node_copy(dest, version, expect_sha256, exclude)
            if hit is not None:
                return hit, "node"
        if swarm is not None:
            try:
                path, chunks = swarm.fetch(self, version, dest, exclude, expect_sha256)
                # where the bytes came from: any peer chunk makes it "peers"; any chunk from S3
                # (the cache tier failed mid-fetch) makes it "durable"; none at all: a node copy
                source: Source = (
                    "peers"
                    if chunks.get("peer")
                    else "durable"
                    if chunks.get("durable")
                    else "cache"
                    if chunks.get("cache")
                    else "node"
                )
                return path, source
            except Exception as e:  # noqa: BLE001 - a broken fan-out (Valkey, a peer, the disk) costs only its speed-up
                log.warning(
                    "version %d: fan-out failed (%s: %s); reading it from the cache tier / S3",
                    version,
                    type(e).__name__,
                    e,
                )
        path, source = self._fetch_tiers(version, dest, exclude, expect_sha256)
        if swarm is not None:  # others may pull it from this node now (best effort)
            try:
                swarm.offer(
                    version, path, Manifest.from_json((path / MANIFEST).read_text()), exclude
                )
            except Exception as e:  # noqa: BLE001 - the copy is fetched and verified; only sharing it failed
                log.warning("version %d: could not offer it to the fan-out: %s", version, e)
        return path, source

    def _fetch_tiers(
        self, version: int, dest: Path, exclude: tuple[str, ...], expect_sha256: str | None
    ) -> tuple[Path, Source]:
        if self.cache is not None:
            try:
                return self.cache.fetch(
                    version, dest, exclude, expect_sha256=expect_sha256
                ), "cache"
            except CheckpointError as e:
                log.warning(
                    "version %d: the cache tier %s cannot serve it (%s); falling back to the durable store %s",
                    version,
                    self.cache.uri,
                    e,
                    self.durable.uri,
                )
        return self.durable.fetch(version, dest, exclude, expect_sha256=expect_sha256), "durable"

    def manifest(self, version: int) -> Manifest:
        """The version's manifest from the nearest remote tier that has it."""
        if self.cache is not None:
            try:
                return self.cache.manifest(version)
            except CheckpointError as e:
                log.warning(
                    "version %d: no manifest from the cache tier (%s); reading the durable one",
                    version,
                    e,
                )
        return self.durable.manifest(version)

    # -- recovery -------------------------------------------------------------------------
    def recover(
        self, scratch: Path | None = None, servable: tuple[int, str] | None = None
    ) -> int | None:
        """Repair both tiers after a publisher died; return the durable `latest` (see the
        module docstring). `scratch`: where versions are staged on their way between tiers
        (a version's engine weights, or a whole version without `trainer/` state: give a folder
        with room, not /tmp).

        `servable`: the (version, manifest sha256) the bus's servable pointer names. Only that
        version is promoted from the cache tier (or adopted in the durable store): a complete
        version nobody made servable (a replaced trainer's, one whose pointer move was refused)
        never enters the lineage. Without it nothing is promoted, and cache-tier versions above
        the durable `latest` are deleted (the run trains those numbers again). A servable
        version with `trainer/` state cannot be promoted either (the cache tier holds no
        `trainer/`, `absent`): it is deleted the same way and trained again; the caller points
        the servable pointer back at the returned durable `latest`. With `epoch` set,
        both tiers record it first (`CheckpointStore.fence`): a replaced trainer's publisher is
        refused from then on, and claims it holds are removed; a live claim of this or a newer
        epoch is left alone.

        Only the cache tier's own failures are forgiven (the run goes on from S3); a failure
        to write the durable store, or of the local disk, is raised: a promotion that cannot
        complete must stop the run rather than drop a trained version."""
        latest = self.durable.recover(self.epoch, servable, self.owner)
        if self.cache is None:
            return latest
        # 1. The cache tier's own recovery; if it fails, the run goes on from the durable store.
        above = self._recover_cache(servable, latest)
        if above is None:
            return latest
        # 2. Its versions above the durable `latest`: the servable one promoted, others deleted.
        for v in above:
            manifest = self._promotable(v, servable, latest)
            if manifest is None:
                continue
            if not self._promote(v, manifest, servable, scratch, latest):
                break
            latest = v
        # 3. The cache tier's `latest` back at the durable one, rebuilt there if it lacks it.
        self._rebuild_cache_latest(latest, scratch)
        return latest

    def _recover_cache(
        self, servable: tuple[int, str] | None, latest: int | None
    ) -> list[int] | None:
        """`recover` step 1: recover the cache tier as a store; return its versions above the
        durable `latest`, or None (logged) if the cache tier is unusable."""
        assert self.cache is not None  # called while recovering the cache tier
        try:
            ensure = getattr(self.cache, "ensure_bucket", None)
            if ensure is not None:  # a restarted cache server: its bucket is gone with its memory
                ensure()
            self.cache.recover(self.epoch, servable, self.owner)
            return [v for v in self.cache.versions() if latest is None or v > latest]
        except CheckpointError as e:
            log.warning(
                "recovery: the cache tier %s is unusable (%s); the run goes on from the durable store",
                self.cache.uri,
                e,
            )
            return None

    def _promotable(
        self, v: int, servable: tuple[int, str] | None, latest: int | None
    ) -> Manifest | None:
        """The manifest of cache-tier version `v` (above the durable `latest`) if it is to be
        promoted; else None, having logged why, and deleted `v` unless a live claim holds it."""
        assert self.cache is not None  # called while recovering the cache tier
        try:
            manifest = self.cache.manifest(v)
        except CheckpointError as e:
            log.warning(
                "recovery: version %d in the cache tier has no readable manifest (%s)", v, e
            )
            return None
        claim = self.cache.read_claim(v)
        if (
            claim is not None
            and claim.owner != self.owner
            and not claim.removable_by(self.epoch, self.cache.clock())
        ):
            log.warning(
                "recovery: version %d in the cache tier is held by a live claim of epoch %s (%s); left "
                "alone",
                v,
                claim.epoch,
                claim.owner,
            )
            return None
        if servable != (v, manifest.sha256()):
            log.warning(
                "recovery: version %d in the cache tier (manifest %s) is not the servable version %s; "
                "deleting it (the run trains that number again)",
                v,
                manifest.sha256()[:12],
                servable,
            )
            self._drop_cache_version(v)
            return None
        lacking = sorted(
            {p for e in manifest.files for p in self.cache.absent if e.path.startswith(p)}
        )
        if lacking:
            log.warning(
                "recovery: version %d was servable in the cache tier but not durable (the "
                "publisher died between the two), and cannot be promoted: its %s state is "
                "only ever written to the durable store, and is not there; deleting it from "
                "the cache tier (the run trains version %d again from version %s; the "
                "servable pointer goes back to that)",
                v,
                ", ".join(lacking),
                v,
                latest,
            )
            self._drop_cache_version(v)
            return None
        return manifest

    def _promote(
        self,
        v: int,
        manifest: Manifest,
        servable: tuple[int, str] | None,
        scratch: Path | None,
        latest: int | None,
    ) -> bool:
        """Copy the servable cache-tier version `v` to the durable store; False (logged) if the
        cache tier cannot read it back, which ends the promotions."""
        assert self.cache is not None and servable is not None  # `_promotable` chose `v`
        with self._staged(scratch) as tmp:
            try:
                # every file verified
                local = self.cache.fetch(v, tmp, expect_sha256=servable[1])
            except CheckpointError as e:
                if not _cache_side(e):
                    raise
                log.warning(
                    "recovery: version %d in the cache tier cannot be read back (%s); the run goes on "
                    "from version %s of the durable store",
                    v,
                    e,
                    latest,
                )
                return False
            self._publish_copy(
                local, self.durable, manifest, self.retention, self.epoch, self.owner
            )
        log.warning(
            "recovery: version %d was servable in the cache tier but not durable (the publisher died "
            "between the two); promoted it to %s",
            v,
            self.durable.uri,
        )
        return True

    def _rebuild_cache_latest(self, latest: int | None, scratch: Path | None) -> None:
        """`recover` step 3: point the cache tier's `latest` back at the durable `latest`, and
        copy that version there if it lacks it; a cache-tier failure is logged, not raised."""
        assert self.cache is not None  # called while recovering the cache tier
        try:
            cache_latest = self.cache.latest()
            if latest is not None and latest in self.cache.versions():
                # the versions above it were dropped
                if cache_latest is not None and cache_latest > latest:
                    self.cache._point_latest(self.cache.manifest(latest), self.epoch, back=True)
            elif latest is not None:
                # the versions above it were dropped
                if cache_latest is not None and cache_latest > latest:
                    # so the rebuild's publish is not refused
                    self.cache._point_latest(None, self.epoch, back=True)
                with self._staged(scratch) as tmp:
                    manifest = self.durable.manifest(latest)
                    self._publish_copy(
                        # only what the cache tier holds (not `trainer/`)
                        self.durable.fetch(latest, tmp, exclude=self.cache.absent),
                        self.cache,
                        manifest,
                        (self.cache_keep, 0),
                        self.epoch,
                        self.owner,
                    )
                log.warning(
                    "recovery: the cache tier lacked version %d (latest); rebuilt it from %s",
                    latest,
                    self.durable.uri,
                )
        except CheckpointError as e:  # the cache tier only: the durable side was read, not written
            log.warning(
                "recovery: could not rebuild the cache tier %s (%s); engines read S3 until it works",
                self.cache.uri,
                e,
            )

    def _drop_cache_version(self, v: int) -> None:
        assert self.cache is not None  # called while recovering the cache tier
        try:
            # first: no longer complete
            self.cache._delete([f"versions/{version_dir(v)}/{MANIFEST}"])
            self.cache._delete_stage(version_dir(v))
        except CheckpointError as e:
            log.warning("recovery: could not delete version %d from the cache tier (%s)", v, e)

    @staticmethod
    def _staged(scratch: Path | None):
        if scratch is not None:
            Path(scratch).mkdir(parents=True, exist_ok=True)
        return tempfile.TemporaryDirectory(prefix="moerl-tier-", dir=scratch)

    @staticmethod
    def _publish_copy(
        local: Path,
        dst: CheckpointStore,
        manifest: Manifest,
        retention: tuple[int, int],
        epoch: int | None = None,
        owner: str | None = None,
    ) -> None:
        for extra in (MANIFEST, MARKER):
            (local / extra).unlink(missing_ok=True)
        dst.publish(
            manifest.version,
            local,
            retention=retention,
            manifest=manifest,
            epoch=epoch,
            owner=owner,
        )


def _cache_side(err: CheckpointError) -> bool:
    """Whether a fetch from the cache tier failed on the cache tier's side (its server, its
    objects), not on this machine's disk (`fetch` says "cannot write" / "cannot create")."""
    text = str(err)
    return not text.startswith(("cannot write version", "cannot create cache folder"))


def node_copy(
    dest: Path, version: int, expect_sha256: str, exclude: tuple[str, ...] = ()
) -> Path | None:
    """A verified copy of exactly that manifest already in the node cache, read without any
    server: its own manifest.json hashes to `expect_sha256` and its marker says so."""
    final = Path(dest) / version_dir(version)
    try:
        with shared(lock_path(Path(dest), version)):
            m = Manifest.from_json((final / MANIFEST).read_text())
            if m.sha256() == expect_sha256 and is_verified(final, m, exclude):
                return final
    except (OSError, CheckpointError):
        pass
    return None


def open_store(cfg: CheckpointConfig) -> CheckpointStore:
    """`s3://bucket/prefix` gives an S3Store; anything else is a local folder. The backends
    are chosen here, not in `moerl.store.base`, so the contract never imports its backends."""
    if cfg.uri.startswith("s3://"):
        from moerl.store.s3 import S3Store  # boto3 only for S3 users

        store: CheckpointStore = S3Store(cfg)
    else:
        store = LocalStore(Path(cfg.uri))
    store.pin_ttl_s, store.claim_ttl_s = cfg.pin_ttl_s, cfg.claim_ttl_s
    return store


def run_store(cfg: CheckpointConfig, run_id: str) -> CheckpointStore:
    """The run's lineage in the durable store: `<checkpoint.uri>/runs/<run_id>`."""
    if not run_id or "/" in run_id:
        raise ValueError(f"run_id must be a non-empty name without '/', got {run_id!r}")
    return open_store(cfg.model_copy(update={"uri": f"{cfg.uri.rstrip('/')}/runs/{run_id}"}))


def run_tiers(cfg: CheckpointConfig, run_id: str, epoch: int | None = None) -> Tiers:
    """`epoch`: the trainer's (`RunBus.claim_trainer`), which fences every write of these tiers;
    None for a writer outside the async trainer (the sync pipeline, `--resume`, benchmarks)."""
    return Tiers(
        run_store(cfg, run_id),
        cache_tier_store(cfg, run_id),
        cfg.chunk_mb * 2**20,
        (cfg.keep_last, cfg.keep_every),
        cfg.cache_tier.keep_last,
        config=cfg,
        epoch=epoch,
    )
