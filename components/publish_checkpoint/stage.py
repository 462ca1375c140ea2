"""Publish checkpoint stage: make policy version v durable in the checkpoint store.

The store writes every file, then the manifest (size + sha256 of each file), reads the
manifest back, and only then moves `latest` (see `moerl.store`). A failure anywhere leaves
`latest` on the previous complete version.

`run_publish` first reads every tensor of the state's `*.safetensors`, one at a time, and
refuses a NaN or an inf before any byte is uploaded: a diverged update never becomes a version.

`prepare_initial` makes version 0: the user's `model.path`, or the tiny model built from its
seed, laid out as a trainer state (HF files; no `trainer/` yet) and published like any other
version. `prepare_resume` lays out a published version (weights + `trainer/`, none for
version 0) to continue from.

Limitations: the finiteness check reads every weight once more (from the page cache, since the
trainer just wrote them); only floating-point tensors in `*.safetensors` files are checked, not
the optimizer state under `trainer/`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from moerl.checkpoints import run_store, version_uri
from moerl.config import RunConfig
from moerl.policy import build_tiny_model, check_checkpoint
from moerl.provenance import git_sha
from moerl.errors import CheckpointError
from moerl.records import PolicyVersion
from moerl.components.policy_update.trainer import TRAINER_DIR


def prepare_initial(cfg: RunConfig, state_dir: str | Path) -> Path:
    """Lay out version 0 as a trainer state directory (no optimizer state yet)."""
    model_dir = Path(state_dir)
    if cfg.model.path:
        check_checkpoint(cfg.model.path)
        shutil.copytree(cfg.model.path, model_dir, dirs_exist_ok=True)
    else:
        build_tiny_model(cfg.model.tiny, model_dir)
    return model_dir


def prepare_resume(cfg: RunConfig, run_id: str, version: int, state_dir: str | Path) -> PolicyVersion:
    """Lay out published `version` (weights + trainer/ state) as the trainer state a resumed
    run continues from. The copy is verified against the manifest on the way."""
    import tempfile

    from moerl.store import MANIFEST, MARKER

    store = run_store(cfg.checkpoint, run_id)
    manifest = store.manifest(version)
    if not any(f.path.startswith(f"{TRAINER_DIR}/") for f in manifest.files) and version > 0:
        raise CheckpointError(f"version {version} in {store.uri} has no {TRAINER_DIR}/ state (optimizer, counters); "
                              "it cannot be resumed from")
    with tempfile.TemporaryDirectory() as tmp:
        local = store.fetch(version, Path(tmp))
        shutil.copytree(local, state_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MANIFEST, MARKER))
    return PolicyVersion(version=version, uri=version_uri(store, version), manifest_sha256=manifest.sha256())


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
                            "latest is unchanged (lower trainer.learning_rate, or resume from latest)")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"refusing to publish version {version}: cannot read {rel} ({e})") from e


def run_publish(cfg: RunConfig, run_id: str, state_dir: str | Path, version: int,
                meta: dict[str, str] | None = None) -> tuple[PolicyVersion, dict[str, float]]:
    """`meta`: extra manifest labels (the async trainer records the groups a version trained on)."""
    t0 = time.perf_counter()
    check_finite(state_dir, version)  # before a byte is uploaded: `latest` stays where it is
    store = run_store(cfg.checkpoint, run_id)
    # the whole state: HF files for the engines, trainer/ for a resumed run
    manifest = store.publish(version, Path(state_dir), meta={**(meta or {}), "run_id": run_id, "git_sha": git_sha()},
                             retention=(cfg.checkpoint.keep_last, cfg.checkpoint.keep_every))
    elapsed = time.perf_counter() - t0
    mb = sum(f.size for f in manifest.files) / 1e6
    policy = PolicyVersion(version=version, uri=version_uri(store, version), manifest_sha256=manifest.sha256())
    return policy, {
        "timing/publish_checkpoint_s": elapsed,
        "weights/publish_mb": mb,
        "weights/publish_mb_per_s": mb / max(elapsed, 1e-9),
        "weights/version": float(version),
    }
