"""The reward-model pipeline's stages (pipelines/reward_model.py), pure of KFP: validate the
preference data and split it, train with the Bradley-Terry loss, evaluate pairwise accuracy
on the held-out split (the publish gate `reward_model.min_accuracy`), publish to the
checkpoint store with a manifest and register it in MLflow's model registry
(moerl/registry/reward_model.py). Each stage logs its metrics on the MLflow run.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from moerl import tracking
from moerl.config import RunConfig
from moerl.errors import TrainingError
from moerl.records import PreferencePair, read_records, write_records
from moerl.registry.reward_model import register
from moerl.store.runs import run_store, version_uri

PUBLISHED_VERSION = 1  # a reward-model run publishes one version: the trained model


def _log(cfg: RunConfig, run_id: str, metrics: dict[str, float]) -> None:
    if run_id:
        tracking.log_metrics(tracking.resolve_uri(cfg.tracking), run_id, 0, metrics)


def prepare_data(
    cfg: RunConfig, train_out: str | Path, eval_out: str | Path, run_id: str = ""
) -> dict[str, float]:
    """Load `reward_model.data` (malformed rows skipped and counted, `task.max_bad_fraction`)
    and write the seeded train / held-out split."""
    from moerl.tasks.preferences import load_preferences, split

    rm = cfg.reward_model
    data = load_preferences(rm.data, cfg.task.max_bad_fraction, ck=cfg.checkpoint)
    train, held_out = split(data.rows, rm.eval_fraction, rm.split_seed)
    write_records(train_out, train)
    write_records(eval_out, held_out)
    metrics = {
        "rm/data_pairs": float(len(data.rows)),
        "rm/data_bad_rows": float(data.bad_rows),
        "rm/train_pairs": float(len(train)),
        "rm/eval_pairs": float(len(held_out)),
    }
    _log(cfg, run_id, metrics)
    return metrics


def train(
    cfg: RunConfig, train_path: str | Path, model_out: str | Path, run_id: str = ""
) -> dict[str, float]:
    """A fresh reward model (the `model` backbone, one-logit head) trained on the train split."""
    from moerl.components.reward_model.model import build_reward_model, train_reward_model

    pairs = read_records(train_path, PreferencePair)
    with tempfile.TemporaryDirectory(prefix="moerl-rm-init-") as init:
        build_reward_model(cfg.model, init, cfg.checkpoint)
        metrics = train_reward_model(
            cfg.reward_model, init, pairs, model_out, device=cfg.trainer.parallelism.device
        )
    _log(cfg, run_id, metrics)
    return metrics


def evaluate(
    cfg: RunConfig, model_path: str | Path, eval_path: str | Path, run_id: str = ""
) -> dict[str, float]:
    """Pairwise accuracy on the held-out split; below `reward_model.min_accuracy` the run fails
    here, before anything is published."""
    from moerl.components.reward_model.model import RewardModel, pairwise_accuracy

    t0 = time.perf_counter()
    metrics = pairwise_accuracy(
        RewardModel(model_path, cfg.trainer.parallelism.device),
        read_records(eval_path, PreferencePair),
    )
    metrics["timing/evaluate_reward_model_s"] = time.perf_counter() - t0
    _log(cfg, run_id, metrics)
    if metrics["rm/eval_accuracy"] < cfg.reward_model.min_accuracy:
        raise TrainingError(
            f"reward_model: held-out pairwise accuracy {metrics['rm/eval_accuracy']:.3f} is below "
            f"reward_model.min_accuracy {cfg.reward_model.min_accuracy}; nothing was published"
        )
    return metrics


def publish(
    cfg: RunConfig, run_id: str, model_path: str | Path, eval_metrics: dict[str, float]
) -> dict[str, str]:
    """Publish the model as version 1 of this run's lineage (`latest` moves only once the
    manifest is verified), register it, and tag the run. Returns {registered, uri, ...}."""
    uri = tracking.resolve_uri(cfg.tracking)
    store = run_store(cfg.checkpoint, run_id)
    accuracy = float(eval_metrics["rm/eval_accuracy"])
    manifest = store.publish(
        PUBLISHED_VERSION,
        Path(model_path),
        meta={
            "kind": "reward_model",
            "run_id": run_id,
            "eval_accuracy": f"{accuracy:.4f}",
            "eval_pairs": str(int(eval_metrics.get("rm/eval_pairs", 0))),
        },
    )
    source = version_uri(store, PUBLISHED_VERSION)
    name = cfg.reward_model.registry_name
    registered = register(
        uri,
        name,
        source,
        run_id,
        store.uri,
        PUBLISHED_VERSION,
        manifest.to_json(),
        manifest.sha256(),
        accuracy,
    )
    out = {
        "registered": f"{name}/{registered}",
        "uri": source,
        "manifest_sha256": manifest.sha256(),
        "version": str(PUBLISHED_VERSION),
    }
    tracking.set_tags(uri, run_id, {f"reward_model.{k}": v for k, v in out.items()})
    print(
        f"[moerl] reward model {out['registered']} (held-out accuracy {accuracy:.3f}) at {source}",
        flush=True,
    )
    return out


def policy_json(published: dict[str, str]) -> str:
    """What finish_run takes (a PolicyVersion's JSON): the published reward model."""
    return json.dumps(
        {
            "version": int(published["version"]),
            "uri": published["uri"],
            "manifest_sha256": published["manifest_sha256"],
        }
    )
