"""Publish checkpoint stage: make policy version v durable in the checkpoint store.

Design, details and limitations: docs/async.md#componentspublish_checkpointstagepy.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from moerl import tracking
from moerl.components.policy_update.trainer import TRAINER_DIR
from moerl.config import RunConfig
from moerl.errors import CheckpointError, ConfigError
from moerl.models.families import source_tags as family_tags
from moerl.models.policy import check_checkpoint
from moerl.models.source import (
    VIEW_DONE,
    ModelImport,
    S3Model,
    _s3_view,
    hf_snapshot,
    local_model,
    model_view,
)
from moerl.models.tiny import build_tiny_model, build_tiny_skeleton
from moerl.provenance import git_sha
from moerl.records import PolicyVersion
from moerl.registry import policy as registry
from moerl.store.base import MANIFEST, MARKER, RemoteParts
from moerl.store.manifest import Manifest
from moerl.store.runs import ENGINE_EXCLUDE, run_store, version_uri
from moerl.store.tiers import run_tiers

FINAL_CHECKPOINT_TAG = "moerl.final_checkpoint"
WARM_START_RUN_TAG, WARM_START_CHECKPOINT_TAG = (
    "moerl.warm_start.run_id",
    "moerl.warm_start.checkpoint",
)
_IN_STORE = re.compile(r"^runs/(?P<run_id>[^/]+)/versions/v(?P<version>\d{6,})$")


@dataclass(frozen=True)
class PreviousCheckpoint:
    """The final checkpoint of an earlier run: its MLflow run, its URI, its version."""

    run_id: str
    uri: str
    version: int


def _store_root(cfg: RunConfig) -> str:
    """checkpoint.uri as `run_store` spells it in version URIs (a local path normalized)."""
    root = cfg.checkpoint.uri.rstrip("/")
    return root if root.startswith("s3://") else str(Path(root))


def find_previous_checkpoint(cfg: RunConfig, current_run_id: str) -> PreviousCheckpoint | None:
    """The newest FINISHED run in `tracking.experiment` (by end time), other than
    `current_run_id`, whose `moerl.final_checkpoint` is a version in this config's checkpoint
    store; None when there is none."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking.resolve_uri(cfg.tracking))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    if exp is None:
        return None
    prefix, token = _store_root(cfg) + "/", None
    while True:
        runs = client.search_runs(
            [exp.experiment_id],
            max_results=200,
            page_token=token,
            filter_string=f"attributes.status = 'FINISHED' and tags.`{FINAL_CHECKPOINT_TAG}` LIKE '%'",
            order_by=["attributes.end_time DESC", "attributes.start_time DESC"],
        )
        for run in runs:
            uri = run.data.tags.get(FINAL_CHECKPOINT_TAG, "")
            m = _IN_STORE.match(uri[len(prefix) :]) if uri.startswith(prefix) else None
            if m and run.info.run_id != current_run_id:
                return PreviousCheckpoint(run.info.run_id, uri, int(m.group("version")))
        token = runs.token
        if not token:
            return None


def fetch_warm_start(cfg: RunConfig, prev: PreviousCheckpoint, model_dir: Path) -> Path:
    """Lay out `prev`'s weights, config and tokenizer (not its `trainer/` state) in
    `model_dir`, every file verified against the version's manifest on the way."""
    import tempfile

    store = run_store(cfg.checkpoint, prev.run_id)
    if version_uri(store, prev.version) != prev.uri:  # the tag and the store must name one version
        raise CheckpointError(
            f"model.warm_start: run {prev.run_id}'s {FINAL_CHECKPOINT_TAG} {prev.uri!r} is not "
            f"{version_uri(store, prev.version)!r}"
        )
    try:
        with tempfile.TemporaryDirectory(prefix="moerl-warm-") as tmp:
            local = store.fetch(prev.version, Path(tmp), exclude=ENGINE_EXCLUDE)
            if not (local / "config.json").is_file() or not any(local.glob("*.safetensors")):
                raise CheckpointError("it holds no config.json and *.safetensors weights")
            shutil.copytree(
                local,
                model_dir,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns(MANIFEST, MARKER),
            )
    except CheckpointError as e:
        raise CheckpointError(
            f"model.warm_start=previous: the final checkpoint {prev.uri} of run {prev.run_id} "
            f"cannot be used: {e}. To start from another run, delete that run's "
            f"{FINAL_CHECKPOINT_TAG} tag in MLflow; to start fresh, set model.warm_start: none"
        ) from e
    return model_dir


def publish_initial(
    cfg: RunConfig, run_id: str, state_dir: str | Path
) -> tuple[PolicyVersion, dict[str, float]]:
    """Version 0 of run `run_id`, published (what init_policy does). A `model.path` in S3 is
    imported without passing through `state_dir`: its small files are laid out there and its
    weights copied into the store as the version's parts (`moerl.models.source.ModelImport`);
    the run is tagged with where it came from."""
    t0 = time.perf_counter()
    parts = _prepare(cfg, Path(state_dir), run_id, weights=False)
    policy, metrics = run_publish(cfg, run_id, state_dir, 0, parts=parts)
    if parts is not None:
        metrics["import/model_mb"] = parts.nbytes / 1e6
        metrics["import/server_side_copies"] = float(
            parts.routes["copy"] + parts.routes["multipart copy"]
        )
        metrics["import/streamed"] = float(parts.routes["stream"])
        metrics["timing/import_model_s"] = time.perf_counter() - t0
        print(
            f"[moerl] model.path {parts.model.uri}: imported {len(parts.model.weights)} weight files "
            f"({parts.nbytes / 1e9:.2f} GB; per store {[dict(t) for t in parts.tiers]}) as version 0 in "
            f"{metrics['timing/import_model_s']:.1f} s",
            flush=True,
        )
    if cfg.model.path and cfg.model.warm_start == "none":
        uri = tracking.resolve_uri(cfg.tracking)
        tracking.set_tags(
            uri, run_id, source_tags(cfg, Path(state_dir), parts, policy.manifest_sha256)
        )
        if parts is not None:
            tracking.log_metrics(
                uri,
                run_id,
                0,
                {k: v for k, v in metrics.items() if k.startswith(("import/", "timing/import"))},
            )
    return policy, metrics


def source_tags(cfg: RunConfig, state_dir: Path, parts, manifest_sha256: str) -> dict[str, str]:
    """What the run's version 0 came from: the source, its family (read from the config.json
    laid out in `state_dir`, not fetched again), its files' ETags digest (S3), and the manifest
    it became."""
    import json

    assert cfg.model.path
    tags = {
        "moerl.model.source": cfg.model.path,
        **family_tags(json.loads((state_dir / "config.json").read_text())),
        "moerl.model.v0_manifest_sha256": manifest_sha256,
    }
    if parts is not None:
        tags["moerl.model.etags_sha256"] = parts.model.digest()
        # per store, in publish order (the cache tier first, where there is one)
        tags["moerl.model.import_routes"] = "; ".join(
            ",".join(f"{k}={v}" for k, v in sorted(t.items())) for t in parts.tiers
        )
        if parts.model.ignored:
            tags["moerl.model.ignored_files"] = ",".join(parts.model.ignored)[:4000]
    return tags


def _link_or_copy(src: str, dst: str) -> None:
    """Weights as hard links (nothing writes them in place); every other file copied, since a
    later step may rewrite it (config.json) and must not write through into the hub cache."""
    if src.endswith(WEIGHT_SUFFIXES):
        try:
            os.link(os.path.realpath(src), dst)
            return
        except OSError:  # another filesystem, or links refused
            pass
    shutil.copy2(src, dst)


def prepare_initial(cfg: RunConfig, state_dir: str | Path, run_id: str | None = None) -> Path:
    """Lay out version 0 as a trainer state directory (no optimizer state yet), every file in
    it (a remote `model.path` is fetched whole: benchmarks and tests; init_policy imports it
    without the folder, `publish_initial`). `run_id`: the current MLflow run (needed with
    `model.warm_start: previous`, which tags it)."""
    _prepare(cfg, Path(state_dir), run_id, weights=True)
    return Path(state_dir)


def _prepare(cfg: RunConfig, model_dir: Path, run_id: str | None, weights: bool):
    """`prepare_initial`; without `weights`, an S3 model's weights are left out of `model_dir`
    and returned as the parts to import (a `ModelImport`), else None."""
    if cfg.model.warm_start.startswith("registry:"):
        _warm_start_from_registry(cfg, model_dir, run_id)
        return None
    if cfg.model.warm_start == "previous":
        if not run_id:
            raise ValueError(
                "prepare_initial: model.warm_start=previous needs run_id (the current MLflow run)"
            )
        prev = find_previous_checkpoint(cfg, run_id)
        if prev is not None:
            fetch_warm_start(cfg, prev, model_dir)
            tracking.set_tags(
                tracking.resolve_uri(cfg.tracking),
                run_id,
                {WARM_START_RUN_TAG: prev.run_id, WARM_START_CHECKPOINT_TAG: prev.uri},
            )
            print(
                f"[moerl] warm start: version 0 is {prev.uri} (the final checkpoint of run {prev.run_id})",
                flush=True,
            )
            return None
        print(
            f"[moerl] warm start: no FINISHED run in experiment {cfg.tracking.experiment!r} has a final checkpoint "
            f"under {_store_root(cfg)}; starting as model.warm_start: none",
            flush=True,
        )
    spec = cfg.model.path
    if spec and spec.startswith("s3://") and not weights:
        model = S3Model(spec, cfg.checkpoint)
        model.check(_s3_view(model, cfg.checkpoint))  # the family, shapes, tokenizer: again here
        model_dir.mkdir(parents=True, exist_ok=True)
        model.fetch_small(model_dir)
        return ModelImport(model)
    if spec and spec.startswith("s3://"):  # a whole local copy, streamed (benchmarks, tests)
        local_model(spec, cfg.checkpoint, model_dir)
    elif spec and spec.startswith("hf://"):
        snap = hf_snapshot(spec)  # downloaded once into the hub cache (the pod's scratch)
        check_checkpoint(snap)
        # the cache's links resolved; hard links where the cache is on the same disk (no second copy)
        shutil.copytree(snap, model_dir, dirs_exist_ok=True, copy_function=_link_or_copy)
    elif spec:
        check_checkpoint(spec)
        shutil.copytree(spec, model_dir, dirs_exist_ok=True)
    else:
        build_tiny_model(cfg.model.tiny, model_dir)
    return None


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SKELETON_DONE = ".moerl-skeleton-complete"


def model_skeleton(cfg: RunConfig, dest: str | Path) -> Path:
    """The model's files without its weights (config, tokenizer, generation config): what an
    engine started on dummy weights needs (`rollout.early_engine`). Every warm start keeps the
    model's architecture, so the skeleton comes from `model.path` or the tiny model's config
    whatever version 0 will be. Raises CheckpointError when `model.path` cannot be read here."""
    import tempfile

    dest = Path(dest)
    if dest.joinpath(SKELETON_DONE).is_file():
        return dest
    try:  # a remote model's small files, fetched once to this node's cache
        view = model_view(cfg.model.path, cfg.checkpoint) if cfg.model.path else None
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    if view is not None and not view.joinpath("config.json").is_file():
        raise CheckpointError(f"model.path {cfg.model.path} has no config.json readable here")
    dest.parent.mkdir(parents=True, exist_ok=True)
    # unique per writer on the node
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        if view is not None:
            for f in view.iterdir():
                if (
                    f.is_file()
                    and not f.name.endswith(WEIGHT_SUFFIXES)
                    and not f.name.endswith(".index.json")
                    and f.name != VIEW_DONE
                ):
                    shutil.copy2(f, tmp / f.name)
        else:
            build_tiny_skeleton(cfg.model.tiny, tmp)
        (tmp / SKELETON_DONE).write_text("")  # last: a skeleton without it is incomplete
        try:
            os.replace(tmp, dest)
        # a neighbour on this node finished first (a non-empty dest), or left a partial one
        except OSError:
            if not dest.joinpath(SKELETON_DONE).is_file():
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _warm_start_from_registry(cfg: RunConfig, model_dir: Path, run_id: str | None) -> Path:
    """Version 0 from the registered policy version `model.warm_start` names (moerl/registry/policy.py): its
    manifest must still be the registered one, and every file is verified on the way."""
    reg = registry.resolve_policy(tracking.resolve_uri(cfg.tracking), cfg.model.warm_start)
    if reg.store_root.rstrip("/") != _store_root(cfg):
        raise CheckpointError(
            f"model.warm_start: {cfg.model.warm_start} is {reg.version_uri}, outside this config's "
            f"checkpoint store {_store_root(cfg)}; set checkpoint.uri to {reg.store_root}"
        )
    found = run_store(cfg.checkpoint, reg.store_run_id).manifest(reg.store_version).sha256()
    if found != reg.manifest_sha256:
        raise CheckpointError(
            f"model.warm_start: {cfg.model.warm_start} ({reg.name}/{reg.registry_version}) was "
            f"registered with manifest {reg.manifest_sha256}, but {reg.version_uri} now holds "
            f"{found}: the published version changed after it was registered"
        )
    fetch_warm_start(
        cfg, PreviousCheckpoint(reg.store_run_id, reg.version_uri, reg.store_version), model_dir
    )
    if run_id:
        tracking.set_tags(
            tracking.resolve_uri(cfg.tracking),
            run_id,
            {
                WARM_START_RUN_TAG: reg.store_run_id,
                WARM_START_CHECKPOINT_TAG: reg.version_uri,
                "moerl.warm_start.registered": f"{reg.name}/{reg.registry_version}",
            },
        )
    print(
        f"[moerl] warm start: version 0 is {reg.version_uri} ({cfg.model.warm_start} = "
        f"{reg.name}/{reg.registry_version})",
        flush=True,
    )
    return model_dir


def prepare_resume(
    cfg: RunConfig,
    run_id: str,
    version: int,
    state_dir: str | Path,
    exclude: tuple[str, ...] = (),
) -> PolicyVersion:
    """Lay out published `version` (weights + trainer/ state) as the trainer state a resumed
    run continues from. The copy is verified against the manifest on the way. `exclude`: path
    prefixes left in the store (a mesh's ranks fetch the state shards they need themselves:
    `STATE_SHARDS`)."""
    import tempfile

    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(version)
    if not any(f.path.startswith(f"{TRAINER_DIR}/") for f in manifest.files) and version > 0:
        raise CheckpointError(
            f"version {version} in {store.uri} has no {TRAINER_DIR}/ state (optimizer, counters); "
            "it cannot be resumed from"
        )
    with tempfile.TemporaryDirectory() as tmp:
        local = store.fetch(version, Path(tmp), exclude=exclude)
        shutil.copytree(
            local, state_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST, MARKER)
        )
    return PolicyVersion(
        version=version, uri=version_uri(store, version), manifest_sha256=manifest.sha256()
    )


def resumable(cfg: RunConfig, run_id: str, version: int) -> PolicyVersion:
    """Published `version` as a run resumes from it: in the durable store, complete, with the
    trainer's state (version 0 starts fresh). Refused otherwise, naming what is missing."""
    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(version)
    if version > 0 and not any(f.path.startswith(f"{TRAINER_DIR}/") for f in manifest.files):
        raise CheckpointError(
            f"version {version} in {store.uri} has no {TRAINER_DIR}/ state (optimizer, counters); "
            "it cannot be resumed from"
        )
    return PolicyVersion(
        version=version, uri=version_uri(store, version), manifest_sha256=manifest.sha256()
    )


def check_finite(state_dir: str | Path, version: int) -> None:
    """Raise a CheckpointError naming the file and the tensor if any floating-point tensor in
    the `*.safetensors` under `state_dir` holds a NaN or an inf. Streams tensor by tensor, so
    memory stays at the largest tensor."""
    import torch
    from safetensors import SafetensorError, safe_open

    state_dir = Path(state_dir)
    for path in sorted(state_dir.rglob("*.safetensors")):
        rel = path.relative_to(state_dir).as_posix()
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        bad = int(t.numel() - torch.isfinite(t).sum())
                        raise CheckpointError(
                            f"refusing to publish version {version}: {rel} tensor {name!r} holds {bad} non-finite "
                            f"values (NaN/inf) of {t.numel()}; the update diverged, so nothing was uploaded and "
                            "latest is unchanged (lower trainer.optimizer.learning_rate, or resume from latest)"
                        )
        except (SafetensorError, OSError) as e:
            raise CheckpointError(
                f"refusing to publish version {version}: cannot read {rel} ({e})"
            ) from e


def run_publish(
    cfg: RunConfig,
    run_id: str,
    state_dir: str | Path,
    version: int,
    meta: dict[str, str] | None = None,
    exclusive: bool = False,
    parts: RemoteParts | None = None,
) -> tuple[PolicyVersion, dict[str, float]]:
    """`meta`: extra manifest labels (the sync update records its batch and metrics).
    `exclusive`: claim the version create-only (see `CheckpointStore.publish`). `parts`: the
    version's files other nodes of the trainer's mesh put themselves (`mesh.NodeParts`)."""
    t0 = time.perf_counter()
    servable, policy, metrics = publish_servable(
        cfg, run_id, state_dir, version, meta, exclusive, parts=parts
    )
    metrics.update(
        publish_durable(
            cfg,
            run_id,
            state_dir,
            servable,
            exclusive,
            started=t0,
            already=not metrics["weights/cache_tier"],
            parts=parts,
        )
    )
    metrics["timing/publish_checkpoint_s"] = metrics["weights/published_to_durable_s"]  # both tiers
    metrics["weights/publish_mb_per_s"] = metrics["weights/publish_mb"] / max(
        metrics["timing/publish_checkpoint_s"], 1e-9
    )
    return policy, metrics


def publish_servable(
    cfg: RunConfig,
    run_id: str,
    state_dir: str | Path,
    version: int,
    meta: dict[str, str] | None = None,
    exclusive: bool = False,
    epoch: int | None = None,
    parts: RemoteParts | None = None,
    owner: str | None = None,
) -> tuple[Manifest, PolicyVersion, dict[str, float]]:
    """The first copy of `version`: refused if not finite, then published to the cache tier
    (or, without one, straight to the durable store). The PolicyVersion names the durable URI
    the version has (or will have) and the manifest both tiers share. `epoch`: the trainer's,
    which fences the writes (`moerl.store.fence`). A version larger than the cache tier can hold
    (`check_tier_fits`) goes to the durable store first, counted (`weights/cache_tier_too_small`).
    `owner`: who claims the version (the same on a retry, which then finds its own claim)."""
    t0 = time.perf_counter()
    check_finite(state_dir, version)  # before a byte is uploaded: `latest` stays where it is
    tiers = run_tiers(cfg.checkpoint, run_id, epoch)
    tiers.owner = owner or tiers.owner
    # the whole state: HF files for the engines, trainer/ for a resumed run
    manifest = tiers.publish_servable(
        version,
        Path(state_dir),
        exclusive=exclusive,
        meta={**(meta or {}), "run_id": run_id, "git_sha": git_sha()},
        parts=parts,
    )
    elapsed = time.perf_counter() - t0
    policy = PolicyVersion(
        version=version, uri=version_uri(tiers.durable, version), manifest_sha256=manifest.sha256()
    )
    cache_ok = tiers.cache is not None and tiers.cache_failed is None
    if tiers.cache is not None and not cache_ok:
        print(
            f"[moerl] version {version}: the checkpoint cache tier failed ({tiers.cache_failed}); published to "
            "the durable store first",
            flush=True,
        )
    return (
        manifest,
        policy,
        {
            "weights/published_to_servable_s": elapsed,
            "weights/version": float(version),
            "weights/cache_tier": float(cache_ok),
            "weights/cache_tier_failed": float(tiers.cache is not None and not cache_ok),
            "weights/cache_tier_too_small": float(tiers.cache_too_small),
        },
    )


def publish_durable(
    cfg: RunConfig,
    run_id: str,
    state_dir: str | Path,
    manifest: Manifest,
    exclusive: bool = False,
    started: float | None = None,
    already: bool = False,
    epoch: int | None = None,
    parts: RemoteParts | None = None,
    owner: str | None = None,
) -> dict[str, float]:
    """The durable copy under the servable copy's manifest; `latest` moves to it. `started`:
    when the version was handed over (perf_counter), for published -> durable. `already`: the
    servable copy was the durable one (no cache tier, or it failed). `owner`: as for
    `publish_servable`."""
    t0 = time.perf_counter()
    if not already:
        tiers = run_tiers(cfg.checkpoint, run_id, epoch)
        tiers.owner = owner or tiers.owner
        tiers.publish_durable(manifest, Path(state_dir), exclusive=exclusive, parts=parts)
    done = time.perf_counter()
    mb = sum(f.size for f in manifest.files) / 1e6
    return {
        "timing/publish_checkpoint_s": done - t0,
        "weights/publish_mb": mb,
        "weights/publish_mb_per_s": mb / max(done - t0, 1e-9),
        "weights/published_to_durable_s": done - (started if started is not None else t0),
    }
