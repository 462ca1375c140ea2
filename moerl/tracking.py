"""The one place metrics reach MLflow.

Design, details and limitations: docs/guide.md#moerltrackingpy.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from moerl.config import RunConfig, TrackingConfig, flatten

log = logging.getLogger(__name__)
_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


# Logged per iteration (sync) or per version (async) under these names, at step = the
# version trained from, so runs of either mode compare side by side in MLflow.
SHARED_METRICS = (
    "reward/mean",
    "reward/std",
    "reward/exact_fraction",
    "reward/failed_samples",
    "response/length_mean",
    "buffer/groups",
    "buffer/dropped_zero_variance_groups",
    "buffer/batch_samples",
    "buffer/staleness_max",
    "train/loss",
    "train/clip_fraction",
    "train/entropy",
    "train/steps",
    "train/logprob_mismatch",
    "timing/iteration_s",
    "timing/policy_update_s",
    "timing/publish_checkpoint_s",
    "throughput/rollout_tokens_per_s",
    "policy/version",
    "weights/version",
)


def redact(value: str) -> str:
    """Drop `user:password@` from any URI inside `value`."""
    return _USERINFO.sub(r"\g<scheme>***@", value)


def split_credentials(cfg: RunConfig) -> tuple[RunConfig, dict[str, str]]:
    """`cfg` without credentials in `tracking.uri`, and the environment variables that carry
    them instead (empty when there were none). Percent-escapes in the userinfo are decoded."""
    uri = cfg.tracking.uri
    if not uri:
        return cfg, {}
    parts = urlsplit(uri)
    if "@" not in parts.netloc:
        return cfg, {}
    userinfo, _, hostport = parts.netloc.rpartition("@")
    if parts.scheme in ("http", "https"):
        clean = urlunsplit(parts._replace(netloc=hostport))
        user, has_password, password = userinfo.partition(":")
        env = {"MLFLOW_TRACKING_USERNAME": unquote(user)}
        if has_password:
            env["MLFLOW_TRACKING_PASSWORD"] = unquote(password)
        if os.environ.get("MLFLOW_TRACKING_URI") == uri:  # it came from there: clean it too
            env["MLFLOW_TRACKING_URI"] = clean
    else:  # a database URI: its driver reads the password from the URI, so the whole URI moves
        clean, env = None, {"MLFLOW_TRACKING_URI": uri}
    return cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"uri": clean})}), env


def resolve_uri(cfg: TrackingConfig) -> str:
    """tracking.uri, else $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db (absolute, so
    pipeline tasks in other working directories write to the same store)."""
    uri = cfg.uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{Path.cwd() / 'mlflow.db'}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).resolve()}"
    return uri


FILE_AUTH = "moerl-credential-files"  # MLFLOW_TRACKING_AUTH's value: the provider below
_file_auth: tuple[str, str] | None = None


def use_credential_files() -> bool:
    """Give this process's MLflow requests the basic-auth credentials of the files named by
    `MLFLOW_TRACKING_USERNAME_FILE` / `MLFLOW_TRACKING_PASSWORD_FILE` (checked and read once:
    `moerl.secrets.read_secret`), in memory only. Cheap and idempotent; False (nothing done, and
    no mlflow import) without both files: a server without auth, or credentials as variables,
    which MLflow reads itself."""
    global _file_auth
    from moerl.secrets import file_var, read_secret

    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    if _file_auth is not None:
        return True
    if not all(os.environ.get(file_var(n)) for n in names):
        return False
    user, password = (read_secret(n) for n in names)
    if not (user and password):  # the Secret's optional keys are absent: no auth
        return False
    from mlflow.tracking.request_auth.abstract_request_auth_provider import RequestAuthProvider
    from mlflow.tracking.request_auth.registry import _request_auth_provider_registry

    class FileCredentials(RequestAuthProvider):
        def get_name(self) -> str:
            return FILE_AUTH

        def get_auth(self):
            import requests.auth

            return requests.auth.HTTPBasicAuth(*_file_auth)

    _file_auth = (user, password)
    # the registry MLflow's entry-point plugins are added to; registering here needs no installed
    # distribution, so it works in a source checkout and in kfp.local's tasks alike
    _request_auth_provider_registry.register(FileCredentials)
    os.environ["MLFLOW_TRACKING_AUTH"] = FILE_AUTH
    return True


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    use_credential_files()

    return MlflowClient(tracking_uri=uri)


def experiment_id(client, name: str) -> str:
    """The id of MLflow experiment `name`, created if it does not exist."""
    exp = client.get_experiment_by_name(name)
    return exp.experiment_id if exp else client.create_experiment(name)


def start_run(cfg: RunConfig, uri: str, tags: dict[str, str]) -> str:
    """Create the run: params are the resolved config, tags the provenance. Returns run_id."""
    from mlflow.entities import RunTag

    client = _client(uri)
    exp_id = experiment_id(client, cfg.tracking.experiment)
    all_tags = {k: redact(v) for k, v in tags.items()}
    if cfg.tracking.run_name:
        all_tags["mlflow.runName"] = cfg.tracking.run_name
    from moerl.tasks.isolation import (
        tags as sandbox_tags,  # `none` shows on the run, never silently
    )

    all_tags.update(sandbox_tags(cfg.reward.sandbox.isolation, cfg.task.sandbox.isolation))
    run = client.create_run(exp_id, tags=all_tags)
    log_params(client, run.info.run_id, flatten(cfg))
    client.log_batch(run.info.run_id, tags=[RunTag("moerl.status", "running")])
    log_dataset_input(client, run.info.run_id, cfg)
    return run.info.run_id


def record_refusal(
    cfg: RunConfig, uri: str, run_id: str, tags: dict[str, str], message: str
) -> str:
    """A run refused before any work (a bad run parameter): the error on the MLflow run, which
    is created from `cfg` (the compiled config) when `run_id` is empty, and marked FAILED.
    Best effort: an unreachable tracking server costs only this record, never the message."""
    try:
        run_id = run_id or start_run(cfg, uri, tags)
        set_tags(uri, run_id, {"moerl.status": "failed", "moerl.error": redact(message)[:4000]})
        _client(uri).set_terminated(run_id, status="FAILED")
    except Exception as err:  # noqa: BLE001 - the refusal itself is printed by the caller and fails the task
        print(
            f"[moerl] could not record the refusal on the MLflow run: {type(err).__name__}: {redact(str(err))}",
            flush=True,
        )
    return run_id


DATASET_PIN_TAG = "moerl.dataset.index_sha256"


def run_tag(uri: str, run_id: str, key: str) -> str | None:
    """Tag `key` of run `run_id`; None when unset, or (said loudly) when the tracking server
    holds no such run (a stage run on its own, outside a pipeline)."""
    from mlflow.exceptions import MlflowException

    try:
        return _client(uri).get_run(run_id).data.tags.get(key)
    except MlflowException as err:
        if getattr(err, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
            raise
        print(
            f"[moerl] WARNING: no MLflow run {run_id!r} at {redact(uri)}; {key} not read",
            flush=True,
        )
        return None


def check_pinned(ds, cfg, run_id: str, field: str = "task.dataset") -> None:
    """Refuse a dataset whose shards are not the ones the run started on (the index the first
    task recorded, `moerl.dataset.index_sha256`): a shard rewritten, added or removed between
    stages would otherwise be trained on silently. A run without the record (its dataset input
    failed, loudly, at the start) is not checked."""
    from moerl.errors import SourceChanged
    from moerl.tasks.shards import index_sha256

    pinned = run_tag(resolve_uri(cfg.tracking), run_id, DATASET_PIN_TAG)
    now = index_sha256(ds.shards)
    if pinned is not None and pinned != now:
        raise SourceChanged(
            f"{field}: {ds.source} is not what run {run_id} started on (shard index sha256 {now[:16]}, "
            f"recorded {pinned[:16]}): a shard was rewritten, added or removed; a source must not "
            "change under a run: write a new prefix and start a new run"
        )


def log_dataset_input(client, run_id: str, cfg: RunConfig) -> None:
    """The run's data as an MLflow dataset input (the UI's Datasets column and run page): its
    spec as the source, the shards' digest (moerl/tasks/shards.py `digest`: one shard's sha256,
    else a sha256 over each shard's name and sha256) and the shard index as the profile. A
    failure is recorded on the run (`moerl.dataset_input_error`), never silent."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag, RunTag

    from moerl.tasks.dataset import load_dataset
    from moerl.tasks.preferences import load_preferences
    from moerl.tasks.shards import digest, index_sha256, profile

    rm = cfg.pipeline.kind == "reward_model"
    spec = cfg.reward_model.data if rm else cfg.task.dataset
    try:
        if rm:
            shards = load_preferences(spec, 1.0, ck=cfg.checkpoint).shards
        else:
            shards = load_dataset(spec, 1.0, cfg.checkpoint).shards
        if spec.startswith("builtin:"):
            name, kind = spec.removeprefix("builtin:"), "moerl-builtin"
        elif spec.startswith("s3://"):
            name, kind = spec.rstrip("/").rsplit("/", 1)[-1], "s3"
        else:
            name, kind = (shards[0].name if len(shards) == 1 else spec.rstrip("/")), "local"
            name = name.rsplit("/", 1)[-1]
        prof = profile(shards)
        text = json.dumps(prof)
        while len(text) > 60_000 and prof["shard_list"]:  # MLflow keeps a bounded profile
            prof["shard_list"] = prof["shard_list"][: len(prof["shard_list"]) // 2]
            text = json.dumps(prof)
        ds = Dataset(
            name=name,
            digest=digest(shards),
            source_type=kind,
            source=json.dumps({"uri": redact(spec)}),
            profile=text,
        )
        client.log_inputs(
            run_id, datasets=[DatasetInput(ds, tags=[InputTag("mlflow.data.context", "training")])]
        )
        # what every later stage must read (`check_pinned`)
        client.log_batch(run_id, tags=[RunTag(DATASET_PIN_TAG, index_sha256(shards))])
    except Exception as err:  # noqa: BLE001 - provenance: recorded on the run, loudly, not fatal
        print(
            f"[moerl] WARNING: the dataset {spec!r} was not logged as an MLflow dataset input: {err}",
            flush=True,
        )
        client.log_batch(
            run_id, tags=[RunTag("moerl.dataset_input_error", redact(str(err))[:4000])]
        )


def register_model_version(
    uri: str,
    name: str,
    description: str,
    run_id: str,
    version_uri: str,
    manifest_json: str,
    artifact_dir: str,
    tags: dict[str, str],
) -> str:
    """A new version of registered model `name` (created if new) for a version published in the
    checkpoint store; returns the registry version. The source is the version's URI for an S3
    store; for a local store it is `runs:/<run_id>/<artifact_dir>`, where the manifest is logged
    (an MLflow server accepts a local path as a source only inside the run's artifacts)."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    try:
        client.create_registered_model(name, description=description)
    except MlflowException as err:
        if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
            raise
    source = version_uri
    if "://" not in version_uri:  # a local store
        client.log_text(run_id, manifest_json, f"{artifact_dir}/manifest.json")
        source = f"runs:/{run_id}/{artifact_dir}"
    return str(client.create_model_version(name, source=source, run_id=run_id, tags=tags).version)


def log_params(client, run_id: str, params: dict[str, Any]) -> None:
    """Log `params` (values redacted, cut to MLflow's 6000 characters) in batches of 100."""
    from mlflow.entities import Param

    items = [Param(k, redact(str(v))[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        client.log_batch(run_id, params=items[i : i + 100])


def log_metrics(uri: str, run_id: str, step: int, metrics: dict[str, float]) -> None:
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step) for k, v in sorted(metrics.items())]
    for i in range(0, len(batch), 500):
        _client(uri).log_batch(run_id, metrics=batch[i : i + 500])


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    from mlflow.entities import RunTag

    _client(uri).log_batch(run_id, tags=[RunTag(k, redact(v)) for k, v in tags.items()])


def set_tags_or_print(uri: str, run_id: str, tags: dict[str, str], what: str) -> bool:
    """`set_tags` from a pod whose MLflow credential may be read-only (the rollout stages':
    `cluster.mlflow_reader_secret`): refused, the tags go to the log instead, in one line saying
    why; False then."""
    from mlflow.exceptions import MlflowException

    try:
        set_tags(uri, run_id, tags)
        return True
    except MlflowException as e:
        if e.error_code != "PERMISSION_DENIED":
            raise
    print(
        f"[moerl] {what}: not set on MLflow run {run_id} (this pod's MLflow credential is "
        f"read-only): {json.dumps({k: redact(v) for k, v in tags.items()})}",
        flush=True,
    )
    return False


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in _client(uri).get_metric_history(run_id, key))


def metric_times(uri: str, run_id: str, key: str) -> list[float]:
    """When each value of `key` was logged (Unix seconds), in step order."""
    return [
        t / 1000.0
        for _, t in sorted(
            (m.step, m.timestamp) for m in _client(uri).get_metric_history(run_id, key)
        )
    ]


def plot_reward_curve(uri: str, run_id: str, out_png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in ("reward/mean", "reward/exact_fraction"):
        hist = metric_history(uri, run_id, key)
        if hist:
            ax.plot([s for s, _ in hist], [v for _, v in hist], marker="o", label=key)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"moerl run {run_id[:8]}")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def finish_run(
    uri: str, run_id: str, final_checkpoint_uri: str, work_dir: Path, status: str = "FINISHED"
) -> None:
    """Log the final checkpoint URI and the reward curve, and close the run."""
    client = _client(uri)
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "final_checkpoint.txt").write_text(final_checkpoint_uri + "\n")
    client.log_artifact(run_id, str(work_dir / "final_checkpoint.txt"))
    client.log_artifact(run_id, str(plot_reward_curve(uri, run_id, work_dir / "reward_curve.png")))
    set_tags(
        uri,
        run_id,
        {"moerl.final_checkpoint": final_checkpoint_uri, "moerl.status": status.lower()},
    )
    client.set_terminated(run_id, status=status)


def reopen_run(uri: str, run_id: str) -> None:
    """Mark a continued run RUNNING again (it was FINISHED or FAILED by the run before)."""
    _client(uri).update_run(run_id, status="RUNNING")
    set_tags(uri, run_id, {"moerl.status": "running"})


def find_kfp_run(uri: str, experiment: str, kfp_run_id: str) -> str | None:
    """The MLflow run that `start_run` tagged with this KFP run id, or None."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None or not kfp_run_id:
        return None
    escaped = kfp_run_id.replace("'", "")
    runs = client.search_runs(
        [exp.experiment_id], filter_string=f"tags.`moerl.kfp_run_id` = '{escaped}'", max_results=1
    )
    return runs[0].info.run_id if runs else None


def close_run(
    uri: str, experiment: str, run_id: str, kfp_run_id: str, succeeded: bool, error: str
) -> str:
    """What the pipeline's exit task does: a run that did not succeed and is still open is
    marked FAILED, with `error` as its `moerl.error` tag. A finished run is left as it is.
    Returns the run's status after this ("" when no MLflow run was ever started)."""
    run_id = run_id or find_kfp_run(uri, experiment, kfp_run_id) or ""
    if not run_id:
        return ""
    client = _client(uri)
    status = client.get_run(run_id).info.status
    if not succeeded and status not in ("FINISHED", "FAILED", "KILLED"):
        set_tags(uri, run_id, {"moerl.status": "failed", "moerl.error": redact(error)[:4000]})
        client.set_terminated(run_id, status="FAILED")
        status = "FAILED"
    return status
