"""Scheduled retraining: `moerl schedule` (a recurring run) and `moerl submit` (one run).

Design, details and limitations: docs/schedule.md#moerlorchestrateschedulepy.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from moerl.config import RunConfig, load_config
from moerl.errors import ConfigError, MoerlError
from moerl.orchestrate.cron import FORMAT, check_timezone, parse_cron

# ----------------------------------------------------------------------------------- KFP

IN_CLUSTER_KFP = "http://ml-pipeline.kubeflow.svc.cluster.local:8888"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def scheduled_config(cfg: RunConfig) -> RunConfig:
    """The config every scheduled run runs: version 0 from the registered policy version an
    operator promoted (`registry:<tracking.registry_name>@champion`) when the config registers
    its policies, else from the previous run's final checkpoint; a warm start the config names
    itself (`registry:...`) is kept."""
    if cfg.model.warm_start.startswith("registry:"):
        return cfg
    warm = (
        f"registry:{cfg.tracking.registry_name}@champion"
        if cfg.tracking.registry_name
        else "previous"
    )
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"warm_start": warm})})


def _check_name(flag: str, name: str, max_len: int) -> str:
    if not (_NAME.match(name) and len(name) <= max_len):
        raise ConfigError(
            f"{flag}: {name!r} must be lowercase letters, digits and '-', start and end with a letter "
            f"or digit, at most {max_len} characters"
        )
    return name


def check_host(flag: str, host: str | None) -> None:
    """Refuse a KFP address with credentials in it: it would be printed, stored in a
    CronWorkflow, and sent nowhere useful (kfp.Client does not authenticate from it)."""
    if host and "@" in urlsplit(host if "://" in host else f"//{host}").netloc:
        raise ConfigError(
            f"{flag}: the KFP address must not carry user:password@ (got a URL with credentials); "
            "kfp.Client authenticates from the kube config or the service-account token"
        )


def _compile(cfg: RunConfig, out: Path) -> Path:
    from moerl.orchestrate.compile import compile_pipeline

    return compile_pipeline(cfg, out, target="eks")


def _kfp_errors() -> tuple[type[BaseException], ...]:
    import kfp_server_api
    import urllib3

    return kfp_server_api.ApiException, urllib3.exceptions.HTTPError, OSError, ValueError


def _kfp_failure(host: str | None, what: str, err: BaseException) -> MoerlError:
    from moerl.tracking import redact

    status = getattr(err, "status", None)
    # An ApiException's text carries the response headers and body; only its status goes out.
    detail = (
        f"HTTP {status} {getattr(err, 'reason', '')}".strip()
        if status
        else f"{type(err).__name__}: {err}"
    )
    return MoerlError(
        f"KFP at {redact(host or '$KF_PIPELINES_ENDPOINT')}: {what} failed ({redact(detail)}); check "
        "--host and that your kube config or token may use the KFP API"
    )


def _kfp_token_credentials(host: str | None) -> Any:
    """kfp.Client's projected-token credentials when there is a host (given or
    $KF_PIPELINES_ENDPOINT) and the token file exists: with a host, kfp.Client's own chain
    never reads it, so a pod's `moerl submit --host ...` would reach a multi-user KFP
    unauthenticated. None otherwise (kfp.Client's chain as it is)."""
    import kfp.client

    token = (
        os.environ.get(kfp.client.KF_PIPELINES_SA_TOKEN_ENV)
        or kfp.client.KF_PIPELINES_SA_TOKEN_PATH
    )
    if not (host or os.environ.get("KF_PIPELINES_ENDPOINT")) or not Path(token).is_file():
        return None
    return kfp.client.ServiceAccountTokenVolumeCredentials(path=None)  # the same env, then path


def _kfp_client(host: str | None, namespace: str | None) -> Any:
    import kfp

    try:
        return kfp.Client(
            host=host, namespace=namespace or "kubeflow", credentials=_kfp_token_credentials(host)
        )
    except _kfp_errors() as err:
        raise _kfp_failure(host, "connecting", err) from None


def _experiment_id(client: Any, name: str, namespace: str | None) -> str:
    try:
        exp = client.get_experiment(experiment_name=name, namespace=namespace)
    except ValueError as err:
        if not str(err).startswith("No experiment is found"):
            raise
        exp = client.create_experiment(name, namespace=namespace)
    return exp.experiment_id


def create_recurring_run(
    cfg: RunConfig,
    cron: str,
    *,
    host: str | None = None,
    experiment: str | None = None,
    job_name: str | None = None,
    namespace: str | None = None,
    service_account: str | None = None,
    timezone: str | None = None,
    config_name: str | None = None,
    client: Any = None,
) -> str:
    """Create a KFP recurring run of `cfg`'s pipeline (compiled for EKS, warm-started) on the
    6-field `cron`; return its id. At most one run at a time, missed ticks not caught up,
    caching off. `client`: a kfp.Client-like object (default: kfp.Client(host, namespace))."""
    # 1. everything that can be refused, before anything is compiled or any client made
    check_host("--host", host)
    schedule = parse_cron(cron)
    if timezone is not None and check_timezone(timezone) != "UTC":
        raise ConfigError(
            f"--timezone {timezone}: KFP recurring runs fire in the scheduledworkflow controller's time "
            "zone (its CRON_SCHEDULE_TIMEZONE); use --no-kfp --argo-out FILE for a zoned schedule"
        )
    name = _check_name("--name", job_name or f"{cfg.pipeline.name}-schedule", 63)
    experiment = experiment or cfg.tracking.experiment
    cfg = scheduled_config(cfg)
    with tempfile.TemporaryDirectory(prefix="moerl-schedule-") as tmp:
        # 2. the pipeline, compiled for the cluster, uploaded as a named version (or reused)
        package = _compile(cfg, Path(tmp) / "pipeline.yaml")
        version = pipeline_version_name(config_name or cfg.pipeline.name, package)
        # 3. the experiment, then the recurring run of that version
        try:
            client = client if client is not None else _kfp_client(host, namespace)
            pipeline_id, version_id, _ = ensure_pipeline_version(
                client,
                package,
                cfg.pipeline.name,
                version,
                namespace,
                description=f"moerl {cfg.pipeline.kind} ({cfg.pipeline.mode})",
            )
            exp_id = _experiment_id(client, experiment, namespace)
            job = client.create_recurring_run(
                experiment_id=exp_id,
                job_name=name,
                description=f"moerl: {cfg.pipeline.name} ({cfg.pipeline.mode}) on '{schedule.kfp}', warm start from "
                "the previous run's final checkpoint",
                cron_expression=schedule.kfp,
                max_concurrency=1,
                no_catchup=True,
                params={},
                pipeline_id=pipeline_id,
                version_id=version_id,
                enabled=True,
                enable_caching=False,
                service_account=service_account,
            )
        except _kfp_errors() as err:
            raise _kfp_failure(host, "creating the recurring run", err) from None
    return job.recurring_run_id


def pipeline_version_name(config_name: str, package: Path) -> str:
    """`<config name>-<git sha>-<spec hash>`: the KFP pipeline version a compiled spec is
    uploaded as. The sha256 of the spec (which carries the config and the git sha as its
    defaults) makes an unchanged pipeline the same version, so it is reused, and any change a
    new one; KFP limits a version's name to 128 characters."""
    import hashlib

    from moerl import provenance

    digest = hashlib.sha256(package.read_bytes()).hexdigest()[:12]
    sha = provenance.git_sha()
    sha = sha[:12] + ("-dirty" if sha.endswith("-dirty") else "")
    stem = re.sub(r"[^a-z0-9-]+", "-", config_name.lower()).strip("-")[:80] or "moerl"
    return f"{stem}-{sha}-{digest}"


def _filter_by_name(name: str) -> str:
    import json

    return json.dumps(
        {"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]}
    )


def ensure_pipeline_version(
    client: Any,
    package: Path,
    pipeline_name: str,
    version_name: str,
    namespace: str | None = None,
    description: str = "",
) -> tuple[str, str, bool]:
    """The KFP pipeline `pipeline_name` (uploaded when missing) and its version
    `version_name` (uploaded when missing, reused when there): (pipeline id, version id,
    reused)."""
    pipeline_id = client.get_pipeline_id(pipeline_name)
    if pipeline_id is None:
        pipeline_id = client.upload_pipeline(
            str(package), pipeline_name=pipeline_name, description=description, namespace=namespace
        ).pipeline_id
    found = client.list_pipeline_versions(
        pipeline_id, page_size=1, filter=_filter_by_name(version_name)
    )
    versions = getattr(found, "pipeline_versions", None) or []
    if versions:
        return pipeline_id, versions[0].pipeline_version_id, True
    version = client.upload_pipeline_version(
        str(package),
        pipeline_version_name=version_name,
        pipeline_id=pipeline_id,
        description=description,
    )
    return pipeline_id, version.pipeline_version_id, False


def run_form_values(cfg: RunConfig, params: list[str]) -> dict[str, Any]:
    """`NAME=VALUE` strings as run-form values, typed by the pipeline's form (pipelines/params.py);
    a name not on the form or a value of the wrong type is a ConfigError naming it."""
    from moerl.pipelines.params import params_for

    form = {p.name: p for p in params_for(cfg)}
    out: dict[str, Any] = {}
    for item in params:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in form:
            raise ConfigError(
                f"--param {item!r}: expected NAME=VALUE with NAME one of {', '.join(sorted(form))} (for "
                "any other key use --override KEY=VALUE)"
            )
        p = form[name]
        if p.type is str:
            out[name] = raw
            continue
        try:
            out[name] = p.type(raw.strip())
        except ValueError:
            raise ConfigError(f"--param {name}: expected {p.type.__name__}, got {raw!r}") from None
    return out


def ui_link(host: str | None, run_id: str) -> str:
    """The KFP UI's page of a run: $KF_PIPELINES_UI_ENDPOINT, else the API host (the UI and
    the API share the address behind KFP's frontend)."""
    from moerl.tracking import redact

    base = (
        os.environ.get("KF_PIPELINES_UI_ENDPOINT")
        or host
        or os.environ.get("KF_PIPELINES_ENDPOINT")
    )
    if not base:
        return f"(run {run_id}; set --host or KF_PIPELINES_UI_ENDPOINT to print its UI link)"
    base = base if "://" in base else f"http://{base}"
    return f"{redact(base.rstrip('/'))}/#/runs/details/{run_id}"


def submit(
    cfg: RunConfig,
    *,
    host: str | None = None,
    experiment: str | None = None,
    run_name: str | None = None,
    namespace: str | None = None,
    service_account: str | None = None,
    wait_timeout_s: int | None = None,
    params: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    config_name: str | None = None,
    client: Any = None,
) -> str:
    """Start one KFP run of `cfg`'s pipeline, compiled for EKS and uploaded as a named pipeline
    version (`pipeline_version_name`; reused when unchanged), with the run form's `params`
    and `overrides` (validated here first, as the run's first task will); return its id.
    Prints the run's UI link and how to find its MLflow run. With `wait_timeout_s`, wait for
    it to end and raise unless it succeeded."""
    from moerl.pipelines.params import merge
    from moerl.tracking import redact, split_credentials

    check_host("--host", host)
    run_name = run_name or f"{cfg.pipeline.name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    form = dict(params or {})
    if "run_name" not in form and not cfg.tracking.run_name:
        form["run_name"] = run_name  # the MLflow run is named like the KFP run
    overrides = list(overrides or [])
    # refused here, before anything is uploaded
    merge(split_credentials(cfg)[0], form, overrides, target="eks")
    with tempfile.TemporaryDirectory(prefix="moerl-submit-") as tmp:
        package = _compile(cfg, Path(tmp) / "pipeline.yaml")
        version = pipeline_version_name(config_name or cfg.pipeline.name, package)
        try:
            client = client if client is not None else _kfp_client(host, namespace)
            pipeline_id, version_id, reused = ensure_pipeline_version(
                client,
                package,
                cfg.pipeline.name,
                version,
                namespace,
                description=f"moerl {cfg.pipeline.kind} ({cfg.pipeline.mode})",
            )
            exp_id = _experiment_id(client, experiment or cfg.tracking.experiment, namespace)
            run = client.run_pipeline(
                experiment_id=exp_id,
                job_name=run_name,
                params={**form, "overrides": overrides},
                pipeline_id=pipeline_id,
                version_id=version_id,
                enable_caching=False,
                service_account=service_account,
            )
        except _kfp_errors() as err:
            raise _kfp_failure(host, "creating the run", err) from None
    print(
        f"[moerl] pipeline {cfg.pipeline.name} version {version} ({'reused' if reused else 'uploaded'})",
        flush=True,
    )
    print(f"[moerl] KFP run {run.run_id} ({run_name}): {ui_link(host, run.run_id)}", flush=True)
    print(
        f"[moerl] MLflow: experiment {cfg.tracking.experiment!r} at {redact(cfg.tracking.uri or '(unset)')}, the run "
        f"tagged moerl.kfp_run_id={run.run_id}",
        flush=True,
    )
    if wait_timeout_s is not None:
        try:
            state = str(client.wait_for_run_completion(run.run_id, wait_timeout_s).state or "")
        except TimeoutError:
            raise MoerlError(
                f"KFP run {run.run_id} did not end within {wait_timeout_s} s"
            ) from None
        except _kfp_errors() as err:
            raise _kfp_failure(host, f"waiting for run {run.run_id}", err) from None
        print(f"[moerl] KFP run {run.run_id} ended: {state}", flush=True)
        if state.lower() != "succeeded":
            raise MoerlError(
                f"KFP run {run.run_id} ended {state or 'without a state'}; see it in the KFP UI"
            )
    return run.run_id


# ---------------------------------------------------------------------------------- Argo

CONFIG_PATH = "/moerl/schedule/run.yaml"
KFP_TOKEN_DIR = (
    "/var/run/secrets/kubeflow/pipelines"  # kfp.Client reads `token` here (multi-user KFP)
)


def cron_workflow(
    cfg: RunConfig,
    cron: str,
    *,
    host: str = IN_CLUSTER_KFP,
    experiment: str | None = None,
    name: str | None = None,
    namespace: str | None = None,
    kfp_namespace: str | None = None,
    service_account: str | None = None,
    timezone: str = "UTC",
    starting_deadline_s: int = 3600,
    history_limit: int = 3,
    wait_timeout_s: int = 7 * 24 * 3600,
    config_name: str | None = None,
) -> dict[str, Any]:
    """An Argo CronWorkflow (argoproj.io/v1alpha1) that starts `cfg`'s pipeline, warm-started,
    through `moerl submit --wait` in the CPU group's image; a plain dict, ready for YAML.
    `host`: the KFP API as the workflow's pod reaches it."""
    from argo_workflows.api_client import ApiClient
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_cron_workflow import (
        IoArgoprojWorkflowV1alpha1CronWorkflow,
    )
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_cron_workflow_spec import (
        IoArgoprojWorkflowV1alpha1CronWorkflowSpec,
    )
    from argo_workflows.model.object_meta import ObjectMeta

    # 1. refuse what cannot be scheduled, before building anything
    check_host("--argo-host", host)
    schedule = parse_cron(cron).argo()
    check_timezone(timezone)
    # Argo suffixes a timestamp
    name = _check_name("--name", name or f"{cfg.pipeline.name}-schedule", 52)
    if starting_deadline_s < 0 or history_limit < 0 or wait_timeout_s < 60:
        raise ConfigError(
            "starting deadline and history limit must be >= 0, the wait timeout >= 60 s"
        )
    # 2. the config the step submits: warm start on, credentials out
    cfg = _without_credentials(scheduled_config(cfg))
    labels = {"app.kubernetes.io/part-of": "moerl", "moerl.ai/pipeline": _label(cfg.pipeline.name)}
    args = _submit_args(
        host,
        experiment or cfg.tracking.experiment,
        wait_timeout_s,
        config_name or cfg.pipeline.name,
        kfp_namespace,
        service_account,
    )
    # 3. the CronWorkflow
    spec = _workflow_spec(cfg, args, wait_timeout_s, service_account)
    cw = IoArgoprojWorkflowV1alpha1CronWorkflow(
        api_version="argoproj.io/v1alpha1",
        kind="CronWorkflow",
        metadata=ObjectMeta(
            name=name, labels=labels, **({"namespace": namespace} if namespace else {})
        ),
        spec=IoArgoprojWorkflowV1alpha1CronWorkflowSpec(
            schedules=[schedule],
            timezone=timezone,
            concurrency_policy="Forbid",
            starting_deadline_seconds=starting_deadline_s,
            successful_jobs_history_limit=history_limit,
            failed_jobs_history_limit=history_limit,
            workflow_metadata=ObjectMeta(labels=labels),
            workflow_spec=spec,
        ),
    )
    out = ApiClient.sanitize_for_serialization(cw)
    return {"apiVersion": out.pop("apiVersion"), "kind": out.pop("kind"), **out}


def _workflow_spec(
    cfg: RunConfig, args: list[str], wait_timeout_s: int, service_account: str | None
) -> Any:
    """The workflow each scheduled time starts: one step running `moerl submit` with `args`,
    the KFP token mounted, under `service_account` when given."""
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_workflow_spec import (
        IoArgoprojWorkflowV1alpha1WorkflowSpec,
    )

    return IoArgoprojWorkflowV1alpha1WorkflowSpec(
        entrypoint="submit",
        templates=[_submit_template(cfg, args)],
        volumes=[_kfp_token_volume()],
        active_deadline_seconds=wait_timeout_s + 600,  # the wait, plus time to compile and submit
        **({"service_account_name": service_account} if service_account else {}),
    )


def _without_credentials(cfg: RunConfig) -> RunConfig:
    """`cfg` without the credentials in `tracking.uri`, which a CronWorkflow must not carry;
    says on stderr where the pipeline's tasks get them instead."""
    from moerl.tracking import split_credentials

    cfg, secret_env = split_credentials(cfg)
    if secret_env:
        print(
            f"moerl: schedule: removed the credentials in tracking.uri from the CronWorkflow; the pipeline's tasks "
            f"get {' and '.join(sorted(secret_env))} from the Secret cluster.mlflow_secret",
            file=sys.stderr,
        )
    return cfg


def _submit_args(
    host: str,
    experiment: str,
    wait_timeout_s: int,
    config_name: str,
    kfp_namespace: str | None,
    service_account: str | None,
) -> list[str]:
    """The `moerl submit` arguments the CronWorkflow's step runs: the mounted config, waited
    for, each run named after its workflow."""
    args = [
        "submit",
        CONFIG_PATH,
        "--host",
        host,
        "--experiment",
        experiment,
        "--run-name",
        "{{workflow.name}}",
        "--wait-timeout-s",
        str(wait_timeout_s),
        "--config-name",
        config_name,
    ]
    if kfp_namespace:
        args += ["--namespace", kfp_namespace]
    if service_account:
        args += ["--service-account", service_account]
    return args


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded config) as literal blocks, readable in the file."""


_Dumper.add_representer(
    str,
    lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None),
)


def dump_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)


def _label(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", value)[:63].strip("-._") or "moerl"


def _submit_template(cfg: RunConfig, args: list[str]) -> Any:
    """The one step: `moerl submit --wait` in the CPU group's image, on the CPU group's nodes."""
    from argo_workflows.model.capabilities import Capabilities
    from argo_workflows.model.container import Container
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_artifact import (
        IoArgoprojWorkflowV1alpha1Artifact,
    )
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_inputs import (
        IoArgoprojWorkflowV1alpha1Inputs,
    )
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_raw_artifact import (
        IoArgoprojWorkflowV1alpha1RawArtifact,
    )
    from argo_workflows.model.io_argoproj_workflow_v1alpha1_template import (
        IoArgoprojWorkflowV1alpha1Template,
    )
    from argo_workflows.model.resource_requirements import ResourceRequirements
    from argo_workflows.model.seccomp_profile import SeccompProfile
    from argo_workflows.model.security_context import SecurityContext
    from argo_workflows.model.toleration import Toleration
    from argo_workflows.model.volume_mount import VolumeMount

    group = cfg.cluster.groups.cpu
    config_yaml = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    tolerations = [
        Toleration(**{k: v for k, v in t.model_dump().items() if v is not None})
        for t in group.tolerations
    ]
    return IoArgoprojWorkflowV1alpha1Template(
        name="submit",
        inputs=IoArgoprojWorkflowV1alpha1Inputs(
            artifacts=[
                IoArgoprojWorkflowV1alpha1Artifact(
                    name="config",
                    path=CONFIG_PATH,
                    raw=IoArgoprojWorkflowV1alpha1RawArtifact(data=config_yaml),
                )
            ]
        ),
        container=Container(
            image=group.image or cfg.pipeline.base_image,
            command=["moerl"],
            args=args,
            resources=ResourceRequirements(
                requests={"cpu": group.cpu, "memory": group.memory}, limits={"memory": group.memory}
            ),
            volume_mounts=[VolumeMount(name="kfp-token", mount_path=KFP_TOKEN_DIR, read_only=True)],
            security_context=SecurityContext(
                allow_privilege_escalation=False,
                capabilities=Capabilities(drop=["ALL"]),
                seccomp_profile=SeccompProfile(type="RuntimeDefault"),
            ),
        ),
        node_selector=dict(group.node_selector),
        tolerations=tolerations,
    )


def _kfp_token_volume() -> Any:
    """A projected service-account token for the KFP API (audience pipelines.kubeflow.org), at
    the path kfp.Client reads by default; nothing secret is written into the manifest."""
    from argo_workflows.model.projected_volume_source import ProjectedVolumeSource
    from argo_workflows.model.service_account_token_projection import ServiceAccountTokenProjection
    from argo_workflows.model.volume import Volume
    from argo_workflows.model.volume_projection import VolumeProjection

    return Volume(
        name="kfp-token",
        projected=ProjectedVolumeSource(
            sources=[
                VolumeProjection(
                    service_account_token=ServiceAccountTokenProjection(
                        path="token", audience="pipelines.kubeflow.org", expiration_seconds=7200
                    )
                )
            ]
        ),
    )


# ----------------------------------------------------------------------------------- CLI


def _cmd_schedule(args: argparse.Namespace) -> int:
    from moerl.tracking import redact

    parse_cron(args.cron)  # 1. refuse a bad schedule or flags before reading anything else
    check_host("--host", args.host)
    check_host("--argo-host", args.argo_host if args.argo_out else None)
    if args.timezone:
        check_timezone(args.timezone)
    if args.no_kfp and not args.argo_out:
        raise ConfigError("--no-kfp: nothing to do without --argo-out FILE")
    cfg = load_config(args.config, args.set, mode=args.mode)
    if args.argo_out:  # 2. the CronWorkflow, validated in full before the KFP schedule exists
        cw = cron_workflow(
            cfg,
            args.cron,
            host=args.argo_host,
            experiment=args.experiment,
            name=args.name,
            namespace=args.argo_namespace,
            kfp_namespace=args.namespace,
            service_account=args.service_account,
            timezone=args.timezone or "UTC",
            config_name=_config_name(args),
        )
        Path(args.argo_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.argo_out).write_text(dump_yaml(cw))
        print(f"wrote {args.argo_out} (kubectl apply -f it, or argo cron create)")
    if not args.no_kfp:  # 3. the KFP recurring run
        job_id = create_recurring_run(
            cfg,
            args.cron,
            host=args.host,
            experiment=args.experiment,
            job_name=args.name,
            namespace=args.namespace,
            service_account=args.service_account,
            timezone=args.timezone,
            config_name=_config_name(args),
        )
        print(
            f"[moerl] KFP recurring run {job_id} on '{parse_cron(args.cron).kfp}' at "
            f"{redact(args.host or '$KF_PIPELINES_ENDPOINT')}",
            flush=True,
        )
    return 0


def _config_name(args: argparse.Namespace) -> str:
    return args.config_name or Path(args.config).stem


def _cmd_submit(args: argparse.Namespace) -> int:
    check_host("--host", args.host)
    cfg = load_config(args.config, args.set, mode=args.mode)
    submit(
        cfg,
        host=args.host,
        experiment=args.experiment,
        run_name=args.run_name,
        namespace=args.namespace,
        service_account=args.service_account,
        wait_timeout_s=args.wait_timeout_s,
        params=run_form_values(cfg, args.param),
        overrides=args.override,
        config_name=_config_name(args),
    )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config")
    p.add_argument(
        "--mode",
        choices=("sync", "async"),
        default=None,
        help="default: the config's pipeline.mode",
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--host",
        default=None,
        help="the KFP API, e.g. http://localhost:8080 through a port-forward "
        "(default: $KF_PIPELINES_ENDPOINT); credentials from the kube config",
    )
    p.add_argument(
        "--experiment", default=None, help="the KFP experiment (default: tracking.experiment)"
    )
    p.add_argument("--namespace", default=None, help="the KFP namespace (multi-user KFP)")
    p.add_argument(
        "--service-account", default=None, help="the Kubernetes service account the runs use"
    )
    p.add_argument(
        "--config-name",
        default=None,
        help="names the uploaded pipeline version "
        "(<config-name>-<git sha>-<spec hash>; default: the file's stem)",
    )


def add_parsers(sub: Any) -> None:
    """Add `schedule` and `submit` to moerl's subcommands."""
    sch = sub.add_parser(
        "schedule",
        help="retrain on a cron schedule (KFP recurring run and/or Argo CronWorkflow), "
        "each run warm-started from the previous run's final checkpoint",
    )
    _common(sch)
    sch.add_argument(
        "--cron",
        required=True,
        help=f"6 fields, {FORMAT} (KFP's format), e.g. '0 0 3 * * *' = 03:00 daily; or @daily etc.",
    )
    sch.add_argument(
        "--name",
        default=None,
        help="the recurring run / CronWorkflow name (default: <pipeline.name>-schedule)",
    )
    sch.add_argument(
        "--timezone",
        default=None,
        help="the CronWorkflow's IANA time zone (default UTC); KFP recurring "
        "runs use the controller's zone",
    )
    sch.add_argument(
        "--argo-out", default=None, metavar="FILE", help="also write an Argo CronWorkflow to FILE"
    )
    sch.add_argument(
        "--argo-host",
        default=IN_CLUSTER_KFP,
        help="the KFP API as the CronWorkflow's pod reaches it",
    )
    sch.add_argument(
        "--argo-namespace", default=None, help="the CronWorkflow's namespace (default: kubectl's)"
    )
    sch.add_argument(
        "--no-kfp", action="store_true", help="only write the CronWorkflow (needs --argo-out)"
    )
    sch.set_defaults(func=_cmd_schedule)

    sbm = sub.add_parser("submit", help="compile for EKS and start one KFP run; print its id")
    _common(sbm)
    sbm.add_argument("--run-name", default=None, help="default: <pipeline.name>-<UTC time>")
    sbm.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a run-form field for this run (model, dataset, learning_rate, ...: `moerl submit` prints "
        "them when NAME is wrong); the compiled config stays the base",
    )
    sbm.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other config key for this run (the run form's overrides list)",
    )
    sbm.add_argument(
        "--wait-timeout-s",
        type=int,
        default=None,
        metavar="S",
        help="wait up to S seconds for the run to end; fail unless it succeeded",
    )
    sbm.set_defaults(func=_cmd_submit)
