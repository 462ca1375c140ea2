"""Scheduled retraining: cron validation (moerl/orchestrate/cron.py), the KFP recurring run, `moerl submit`, and the Argo
CronWorkflow checked against Argo's published JSON schema (tests/data/argo, see its NOTICE).

There is no KFP server here: the KFP calls go to `FakeKfp`, a pure-logic stand-in that binds
every call to the real `kfp.Client` method's signature (a wrong or missing argument fails as it
would against kfp) and records it. The pipeline package it receives is the real compiled one.
"""

import argparse
import copy
import inspect
import json
import re
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kfp
import pytest
import yaml

from moerl.config import load_config, parse_config
from moerl.errors import ConfigError, MoerlError
from moerl.orchestrate import schedule
from moerl.orchestrate.cron import parse_cron

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "data" / "argo" / "cronworkflow.schema.json").read_text()
)

# ------------------------------------------------------------------------------------ cron


@pytest.mark.parametrize(
    "expr, kfp_form, argo_form",
    [
        ("0 0 3 * * *", "0 0 3 * * *", "0 3 * * *"),
        ("  0  0 3 * *   * ", "0 0 3 * * *", "0 3 * * *"),
        ("0 */15 * * * *", "0 */15 * * * *", "*/15 * * * *"),
        ("0 0 9 ? * 2-6", "0 0 9 ? * 2-6", "0 9 * * 2-6"),  # kfp.Client's docstring example
        ("0 30 2 1,15 * ?", "0 30 2 1,15 * ?", "30 2 1,15 * *"),
        ("0 0 0 * JAN-MAR,dec sun", "0 0 0 * JAN-MAR,dec sun", "0 0 * JAN-MAR,dec sun"),
        (
            "0 5-59/10 8-18 1-31/2 2/3 MON-FRI",
            "0 5-59/10 8-18 1-31/2 2/3 MON-FRI",
            "5-59/10 8-18 1-31/2 2/3 MON-FRI",
        ),
        ("0 59 23 31 12 6", "0 59 23 31 12 6", "59 23 31 12 6"),
        ("@daily", "0 0 0 * * *", "0 0 * * *"),
        ("@Midnight", "0 0 0 * * *", "0 0 * * *"),
        ("@hourly", "0 0 * * * *", "0 * * * *"),
        ("@weekly", "0 0 0 * * 0", "0 0 * * 0"),
        ("@monthly", "0 0 0 1 * *", "0 0 1 * *"),
        ("@yearly", "0 0 0 1 1 *", "0 0 1 1 *"),
    ],
)
def test_good_cron(expr, kfp_form, argo_form):
    cron = parse_cron(expr)
    assert cron.kfp == kfp_form
    assert cron.argo() == argo_form


@pytest.mark.parametrize(
    "expr, message",
    [
        (
            "0 3 * * *",
            "expected 6 fields (second minute hour day-of-month month day-of-week), got 5 in '0 3 * * *'; "
            "KFP takes a leading seconds field, e.g. '0 0 3 * * *'",
        ),
        ("0 0 0 0 3 * * *", "expected 6 fields"),
        ("", "got 0"),
        ("60 * * * * *", "cron: field 1 (second) must be 0-59, got '60'"),
        (
            "? * * * * *",
            "cron: field 1 (second): '?' is allowed only in day of month and day of week",
        ),
        ("0 60 * * * *", "cron: field 2 (minute) must be 0-59, got '60'"),
        ("0 -5 * * * *", "cron: field 2 (minute) must be 0-59, got ''"),
        ("0 5-1 * * * *", "cron: field 2 (minute): range '5-1' runs backwards (5 > 1)"),
        ("0 1,,2 * * * *", "cron: field 2 (minute): empty item in list '1,,2'"),
        (
            "0 */0 * * * *",
            "cron: field 2 (minute): step must be a positive integer, got '0' in '*/0'",
        ),
        ("0 0 25 * * *", "cron: field 3 (hour) must be 0-23, got '25'"),
        ("0 0 ? * * *", "cron: field 3 (hour): '?' is allowed only"),
        ("0 0 0 0 * *", "cron: field 4 (day of month) must be 1-31, got '0'"),
        ("0 0 0 32 * *", "cron: field 4 (day of month) must be 1-31, got '32'"),
        (
            "0 0 0 L * *",
            "cron: field 4 (day of month) must be 1-31, got 'L' (L, W and # are not supported)",
        ),
        ("0 0 0 15W * *", "(L, W and # are not supported)"),
        ("0 0 0 * 13 *", "cron: field 5 (month) must be 1-12 or JAN-DEC, got '13'"),
        ("0 0 0 * 0 *", "cron: field 5 (month) must be 1-12 or JAN-DEC, got '0'"),
        ("0 0 0 * FOO *", "cron: field 5 (month) must be 1-12 or JAN-DEC, got 'FOO'"),
        ("0 0 0 * * 7", "cron: field 6 (day of week) must be 0-6 or SUN-SAT, got '7'"),
        ("0 0 0 * * MON-FOO", "cron: field 6 (day of week) must be 0-6 or SUN-SAT, got 'FOO'"),
        (
            "0 0 0 * * 1#2",
            "cron: field 6 (day of week) must be 0-6 or SUN-SAT, got '1#2' (L, W and # are not supported)",
        ),
        (
            "0 0 0 * * MON/x",
            "cron: field 6 (day of week): step must be a positive integer, got 'x'",
        ),
        ("0 0 0 * * FRI-MON", "runs backwards (5 > 1)"),
        ("@every 1h", "cron: unknown descriptor '@every 1h'"),
        ("@reboot", "unknown descriptor"),
    ],
)
def test_bad_cron_names_the_field(expr, message):
    with pytest.raises(ConfigError) as err:
        parse_cron(expr)
    assert message in str(err.value)


@pytest.mark.parametrize(
    "expr", ["30 0 3 * * *", "*/10 * * * * *", "0,30 * * * * *", "5/10 * * * * *"]
)
def test_argo_refuses_a_seconds_field_other_than_0(expr):
    cron = parse_cron(expr)  # fine for KFP
    assert cron.kfp == expr
    with pytest.raises(
        ConfigError, match=r"cron: field 1 \(second\) is .*--argo-out needs a seconds field of 0"
    ):
        cron.argo()


def test_quartz_hint_only_for_quartz_syntax():
    with pytest.raises(ConfigError) as err:
        parse_cron("0 0 0 * APRIL *")
    assert str(err.value) == "cron: field 5 (month) must be 1-12 or JAN-DEC, got 'APRIL'"


def test_step_without_range_runs_to_the_field_maximum():
    assert parse_cron("5/20 * * * * *").seconds == {5, 25, 45}
    assert parse_cron("00 * * * * *").argo() == "* * * * *"  # second 0 spelled 00


# ------------------------------------------------------------------------------- KFP calls


def _cfg(**extra):
    data = {
        "checkpoint": {"uri": "s3://bucket/moerl"},
        "tracking": {"uri": "http://mlflow.mlflow:5000"},
        "pipeline": {"iterations": 2, "base_image": "registry.example/moerl-cpu:0.1.0"},
    }
    for key, value in extra.items():
        data.setdefault(key, {}).update(value)
    return parse_config(data)


class FakeKfp:
    """Records each call after binding it to the real kfp.Client method's signature."""

    def __init__(self, experiment_exists=False, final_state="SUCCEEDED", fail_with=None):
        self.calls, self.packages = [], []
        self.experiment_exists, self.final_state, self.fail_with = (
            experiment_exists,
            final_state,
            fail_with,
        )
        self.pipelines: dict[str, str] = {}  # name -> id
        self.versions: dict[str, list[tuple[str, str]]] = {}  # pipeline id -> [(version name, id)]

    # the pipeline registry, as the KFP API keeps it: pipelines by name, versions by name
    def get_pipeline_id(self, *args, **kwargs):
        self._record("get_pipeline_id", *args, **kwargs)
        return self.pipelines.get(self.calls[-1][1]["name"])

    def upload_pipeline(self, *args, **kwargs):
        self._record("upload_pipeline", *args, **kwargs)
        kw = self.calls[-1][1]
        self._keep_package(kw["pipeline_package_path"])
        pid = self.pipelines[kw["pipeline_name"]] = f"p-{len(self.pipelines) + 1}"
        self.versions[pid] = [(kw["pipeline_name"], f"{pid}-v0")]  # KFP's default first version
        return SimpleNamespace(pipeline_id=pid)

    def list_pipeline_versions(self, *args, **kwargs):
        self._record("list_pipeline_versions", *args, **kwargs)
        kw = self.calls[-1][1]
        (pred,) = json.loads(kw["filter"])["predicates"]
        assert pred["operation"] == "EQUALS" and pred["key"] == "display_name"
        hits = [
            SimpleNamespace(pipeline_version_id=vid, display_name=name)
            for name, vid in self.versions.get(kw["pipeline_id"], [])
            if name == pred["stringValue"]
        ]
        return SimpleNamespace(pipeline_versions=hits or None)

    def upload_pipeline_version(self, *args, **kwargs):
        self._record("upload_pipeline_version", *args, **kwargs)
        kw = self.calls[-1][1]
        self._keep_package(kw["pipeline_package_path"])
        vid = f"{kw['pipeline_id']}-v{len(self.versions[kw['pipeline_id']])}"
        self.versions[kw["pipeline_id"]].append((kw["pipeline_version_name"], vid))
        return SimpleNamespace(pipeline_version_id=vid)

    def run_pipeline(self, *args, **kwargs):
        self._record("run_pipeline", *args, **kwargs)
        return SimpleNamespace(run_id=f"run-{sum(1 for n, _ in self.calls if n == 'run_pipeline')}")

    def _record(self, name, *args, **kwargs):
        bound = inspect.signature(getattr(kfp.Client, name)).bind(self, *args, **kwargs)
        self.calls.append((name, {k: v for k, v in bound.arguments.items() if k != "self"}))
        if self.fail_with is not None:
            raise self.fail_with

    def _keep_package(self, path):
        self.packages.append(list(yaml.safe_load_all(Path(path).read_text())))

    def get_experiment(self, *args, **kwargs):
        self._record("get_experiment", *args, **kwargs)
        if not self.experiment_exists:
            raise ValueError("No experiment is found with name moerl.")
        return SimpleNamespace(experiment_id="exp-1")

    def create_experiment(self, *args, **kwargs):
        self._record("create_experiment", *args, **kwargs)
        return SimpleNamespace(experiment_id="exp-new")

    def create_recurring_run(self, *args, **kwargs):
        self._record("create_recurring_run", *args, **kwargs)
        return SimpleNamespace(recurring_run_id="rr-1")

    def wait_for_run_completion(self, *args, **kwargs):
        self._record("wait_for_run_completion", *args, **kwargs)
        return SimpleNamespace(state=self.final_state)


def _config_of(package):
    """The run config a compiled pipeline carries (the config_json parameter's default)."""
    return parse_config(
        json.loads(
            package[0]["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"]
        )
    )


def _calls(fake, *names):
    return [kw for name, kw in fake.calls if name in names]


def test_recurring_run_gets_the_right_arguments():
    fake = FakeKfp()
    rid = schedule.create_recurring_run(
        _cfg(),
        "0 0 3 * * MON-FRI",
        experiment="nightly",
        service_account="runner",
        config_name="tiny-moe-grpo",
        client=fake,
    )
    assert rid == "rr-1"
    names = [name for name, _ in fake.calls]
    assert names == [
        "get_pipeline_id",
        "upload_pipeline",
        "list_pipeline_versions",
        "upload_pipeline_version",
        "get_experiment",
        "create_experiment",
        "create_recurring_run",
    ]
    assert _calls(fake, "get_experiment")[0] == {"experiment_name": "nightly", "namespace": None}
    (kw,) = _calls(fake, "create_recurring_run")
    assert kw["experiment_id"] == "exp-new" and kw["job_name"] == "moerl-grpo-schedule"
    assert kw["cron_expression"] == "0 0 3 * * MON-FRI"
    assert kw["max_concurrency"] == 1 and kw["no_catchup"] is True and kw["enabled"] is True
    assert (
        kw["enable_caching"] is False and kw["service_account"] == "runner" and kw["params"] == {}
    )
    assert "interval_second" not in kw and "pipeline_package_path" not in kw
    # the schedule runs the named version it uploaded
    (version,) = _calls(fake, "upload_pipeline_version")
    assert version["pipeline_version_name"].startswith("tiny-moe-grpo-")
    assert (kw["pipeline_id"], kw["version_id"]) == ("p-1", "p-1-v1")
    # the package: compiled for EKS (pod settings present), and every run of it warm-starts
    package = fake.packages[-1]
    assert _config_of(package).model.warm_start == "previous"
    assert any("kubernetes" in doc.get("platforms", {}) for doc in package[1:])


def test_recurring_run_reuses_an_existing_experiment():
    fake = FakeKfp(experiment_exists=True)
    schedule.create_recurring_run(_cfg(), "@daily", client=fake)
    assert [name for name, _ in fake.calls if "experiment" in name] == ["get_experiment"]
    # default: tracking.experiment
    assert _calls(fake, "get_experiment")[0]["experiment_name"] == "moerl"
    (kw,) = _calls(fake, "create_recurring_run")
    assert kw["experiment_id"] == "exp-1" and kw["cron_expression"] == "0 0 0 * * *"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cron": "0 0 25 * * *"}, "cron: field 3 (hour) must be 0-23, got '25'"),
        ({"cron": "0 3 * * *"}, "expected 6 fields"),
        (
            {"cron": "0 0 3 * * *", "timezone": "Europe/Berlin"},
            "KFP recurring runs fire in the scheduledworkflow",
        ),
        (
            {"cron": "0 0 3 * * *", "timezone": "Mars/Olympus"},
            "--timezone: 'Mars/Olympus' is not an IANA time zone",
        ),
        (
            {"cron": "0 0 3 * * *", "job_name": "Nightly_Run"},
            "--name: 'Nightly_Run' must be lowercase",
        ),
    ],
)
def test_refusal_comes_before_any_compile_or_client_call(kwargs, message, monkeypatch):
    compiled = []
    monkeypatch.setattr(schedule, "_compile", lambda cfg, out: compiled.append(out))
    fake = FakeKfp()
    with pytest.raises(ConfigError) as err:
        schedule.create_recurring_run(_cfg(), client=fake, **kwargs)
    assert message in str(err.value)
    assert fake.calls == [] and compiled == []


def test_a_config_that_is_not_cluster_safe_is_refused_before_any_client_call():
    fake = FakeKfp()
    with pytest.raises(ConfigError, match="checkpoint.uri"):
        schedule.create_recurring_run(
            parse_config({"tracking": {"uri": "http://mlflow:5000"}}), "@daily", client=fake
        )
    assert fake.calls == []


def test_kfp_errors_are_one_line_without_the_response_body():
    import kfp_server_api

    err = kfp_server_api.ApiException(status=403, reason="Forbidden")
    err.body, err.headers = "token=hunter2", {"Set-Cookie": "session=hunter2"}
    with pytest.raises(MoerlError) as caught:
        schedule.create_recurring_run(
            _cfg(), "@daily", host="http://kfp:8888", client=FakeKfp(fail_with=err)
        )
    text = str(caught.value)
    assert (
        "HTTP 403 Forbidden" in text
        and "creating the recurring run" in text
        and "KFP at http://kfp:8888" in text
    )
    assert "hunter2" not in text


def _free_port() -> int:
    import socket

    with socket.socket() as s:  # a free port, closed again
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_kfp_is_one_error_after_the_compile(monkeypatch):
    """The real kfp.Client (its constructor checks /healthz) against a port nothing listens on."""
    port = _free_port()
    with pytest.raises(MoerlError) as err:
        schedule.create_recurring_run(_cfg(), "@daily", host=f"http://127.0.0.1:{port}")
    assert f"KFP at http://127.0.0.1:{port}: connecting failed" in str(err.value)
    # an address from $KF_PIPELINES_ENDPOINT is not refused, but never printed with its password
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", f"http://user:pw@127.0.0.1:{port}")
    with pytest.raises(MoerlError) as err:
        schedule.submit(_cfg())
    assert "KFP at $KF_PIPELINES_ENDPOINT: connecting failed" in str(err.value) and "pw" not in str(
        err.value
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda c: schedule.create_recurring_run(
            _cfg(), "@daily", host="http://alice:s3cret@kfp:8888", client=c
        ),
        # no scheme: kfp adds https://
        lambda c: schedule.submit(_cfg(), host="alice:s3cret@kfp:8888", client=c),
    ],
)
def test_a_host_with_credentials_is_refused_before_any_compile_or_client_call(call, monkeypatch):
    compiled = []
    monkeypatch.setattr(schedule, "_compile", lambda cfg, out: compiled.append(out))
    fake = FakeKfp()
    with pytest.raises(
        ConfigError, match="^--host: the KFP address must not carry user:password@"
    ) as err:
        call(fake)
    assert "s3cret" not in str(err.value) and fake.calls == [] and compiled == []
    with pytest.raises(ConfigError, match="^--argo-host: "):
        schedule.cron_workflow(
            _cfg(), "@daily", host="http://alice:s3cret@ml-pipeline.kubeflow:8888"
        )


class _KfpApi:
    """A local HTTP server answering kfp.Client's /healthz, recording each request's
    Authorization header (what a multi-user KFP's auth proxy would check)."""

    def __init__(self):
        import http.server
        import threading

        seen = self.authorization = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                seen.append(self.headers.get("Authorization"))
                body = b'{"multi_user": false}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_the_projected_kfp_token_is_sent_with_an_explicit_host(tmp_path, monkeypatch):
    """With --host, kfp.Client alone never reads the service-account token; moerl passes it,
    read from kfp's own token path (here redirected by kfp's KF_PIPELINES_SA_TOKEN_PATH)."""
    import kfp.client

    monkeypatch.setenv("HOME", str(tmp_path))  # no kfp context file of the developer's
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    token = tmp_path / "token"
    monkeypatch.setenv(kfp.client.KF_PIPELINES_SA_TOKEN_ENV, str(token))
    api = _KfpApi()
    try:
        schedule._kfp_client(api.host, None)  # no token file: kfp.Client's chain as it is
        assert api.authorization == [None]
        token.write_text("projected-token-1")
        client = schedule._kfp_client(api.host, None)
        assert api.authorization[-1] == "Bearer projected-token-1"
        token.write_text("projected-token-2")  # the kubelet rotates it: read again per request
        client.get_kfp_healthz()
        assert api.authorization[-1] == "Bearer projected-token-2"
    finally:
        api.close()


def test_submit_uploads_a_named_version_starts_one_run_and_waits_for_it(capsys, monkeypatch):
    monkeypatch.delenv("KF_PIPELINES_UI_ENDPOINT", raising=False)
    fake = FakeKfp()
    cfg = _cfg()
    assert (
        schedule.submit(
            cfg,
            host="http://kfp.example:8080",
            run_name="nightly-1",
            experiment="nightly",
            wait_timeout_s=600,
            config_name="tiny-moe-grpo",
            client=fake,
        )
        == "run-1"
    )
    assert [name for name, _ in fake.calls] == [
        "get_pipeline_id",
        "upload_pipeline",
        "list_pipeline_versions",
        "upload_pipeline_version",
        "get_experiment",
        "create_experiment",
        "run_pipeline",
        "wait_for_run_completion",
    ]
    (up,) = _calls(fake, "upload_pipeline")
    assert up["pipeline_name"] == "moerl-grpo"
    (version,) = _calls(fake, "upload_pipeline_version")
    name = version["pipeline_version_name"]
    assert re.fullmatch(
        r"tiny-moe-grpo-[0-9a-f]{7,12}(-dirty)?-[0-9a-f]{12}|tiny-moe-grpo-unknown-[0-9a-f]{12}",
        name,
    )
    (run,) = _calls(fake, "run_pipeline")
    assert run["job_name"] == "nightly-1" and run["enable_caching"] is False
    assert (run["pipeline_id"], run["version_id"]) == (
        "p-1",
        "p-1-v1",
    ) and "pipeline_package_path" not in run
    # the MLflow run is named like the KFP run; no other field changes
    assert run["params"] == {"run_name": "nightly-1", "overrides": []}
    assert _calls(fake, "wait_for_run_completion") == [{"run_id": "run-1", "timeout": 600}]
    # submit runs the config as given (no warm start added)
    assert _config_of(fake.packages[-1]) == cfg
    out = capsys.readouterr().out
    assert f"version {name} (uploaded)" in out
    assert "[moerl] KFP run run-1 (nightly-1): http://kfp.example:8080/#/runs/details/run-1" in out
    assert "moerl.kfp_run_id=run-1" in out and "ended: SUCCEEDED" in out


def test_submit_reuses_an_unchanged_version_and_a_changed_config_is_a_new_one(capsys):
    fake = FakeKfp()
    schedule.submit(_cfg(), config_name="tiny", client=fake)
    schedule.submit(
        _cfg(),
        config_name="tiny",
        client=fake,
        params={"learning_rate": 1e-3},
        overrides=["rollout.temperature=0.7"],
    )
    # the second submission found the version by name: nothing uploaded again
    assert (
        len(_calls(fake, "upload_pipeline")) == 1
        and len(_calls(fake, "upload_pipeline_version")) == 1
    )
    first, second = _calls(fake, "run_pipeline")
    assert first["version_id"] == second["version_id"] == "p-1-v1"
    assert second["params"]["learning_rate"] == 1e-3 and second["params"]["overrides"] == [
        "rollout.temperature=0.7"
    ]
    assert "(reused)" in capsys.readouterr().out
    schedule.submit(
        _cfg(trainer={"optimizer": {"learning_rate": 5e-4}}), config_name="tiny", client=fake
    )
    versions = _calls(fake, "upload_pipeline_version")
    assert (
        len(versions) == 2
        and versions[0]["pipeline_version_name"] != versions[1]["pipeline_version_name"]
    )
    assert _calls(fake, "run_pipeline")[-1]["version_id"] == "p-1-v2"


@pytest.mark.parametrize(
    "params,overrides,message",
    [
        ({"learning_rate": -1.0}, [], "trainer.optimizer.learning_rate"),
        ({}, ["pipeline.iterations=5"], "pipeline.iterations cannot change per run"),
        ({"dataset": "/home/me/prompts.jsonl"}, [], "task.dataset"),  # not cluster-safe
    ],
)
def test_submit_refuses_a_bad_run_form_before_any_client_call(
    params, overrides, message, monkeypatch
):
    compiled = []
    monkeypatch.setattr(schedule, "_compile", lambda cfg, out: compiled.append(out))
    fake = FakeKfp()
    with pytest.raises(ConfigError, match=re.escape(message)):
        schedule.submit(_cfg(), params=params, overrides=overrides, client=fake)
    assert fake.calls == [] and compiled == []


def test_param_flags_are_typed_by_the_run_form():
    cfg = _cfg()
    assert schedule.run_form_values(
        cfg,
        [
            "learning_rate=1e-3",
            "samples_per_prompt=4",
            "run_name=123",
            "dataset=builtin:digits-add",
        ],
    ) == {
        "learning_rate": 1e-3,
        "samples_per_prompt": 4,
        "run_name": "123",
        "dataset": "builtin:digits-add",
    }
    with pytest.raises(ConfigError, match="--param samples_per_prompt: expected int, got 'four'"):
        schedule.run_form_values(cfg, ["samples_per_prompt=four"])
    with pytest.raises(ConfigError, match="NAME one of .*learning_rate.*--override KEY=VALUE"):
        schedule.run_form_values(cfg, ["trainer.loss.clip_eps_high=0.3"])
    with pytest.raises(ConfigError, match="NAME one of"):
        schedule.run_form_values(cfg, ["versions=3"])  # async only


def test_submit_fails_when_the_run_does_not_succeed():
    with pytest.raises(MoerlError, match="KFP run run-1 ended FAILED"):
        schedule.submit(_cfg(), wait_timeout_s=600, client=FakeKfp(final_state="FAILED"))
    fake = FakeKfp()
    schedule.submit(_cfg(), client=fake)  # no wait
    assert "wait_for_run_completion" not in [name for name, _ in fake.calls]
    assert _calls(fake, "run_pipeline")[0]["job_name"].startswith("moerl-grpo-")


# ------------------------------------------------------------------------------ CronWorkflow


def _strict(schema):
    """The schema with unknown properties refused wherever it lists properties: Argo's schema
    allows any extra key, so a misspelt or removed field (v4 dropped `schedule`) would pass."""
    out = copy.deepcopy(schema)
    for d in out["definitions"].values():
        if "properties" in d and "additionalProperties" not in d:
            d["additionalProperties"] = False
    return out


def _validate(doc):
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    jsonschema.Draft202012Validator(_strict(SCHEMA)).validate(doc)


def test_cron_workflow_validates_against_argo_schema():
    cfg = _cfg(
        cluster={
            "groups": {"cpu": {"image": "registry/moerl-cpu:1.2.3", "cpu": "500m", "memory": "2Gi"}}
        },
        tracking={"uri": "http://alice:s3cret@mlflow.mlflow:5000", "experiment": "nightly"},
    )
    cw = schedule.cron_workflow(
        cfg,
        "0 0 3 ? * MON-FRI",
        timezone="Europe/Berlin",
        namespace="ml",
        kfp_namespace="team-a",
        service_account="moerl-runner",
    )
    _validate(cw)
    _validate(yaml.safe_load(schedule.dump_yaml(cw)))  # and as written to the file
    assert cw["apiVersion"] == "argoproj.io/v1alpha1" and cw["kind"] == "CronWorkflow"
    assert cw["metadata"] == {
        "name": "moerl-grpo-schedule",
        "namespace": "ml",
        "labels": {"app.kubernetes.io/part-of": "moerl", "moerl.ai/pipeline": "moerl-grpo"},
    }
    spec = cw["spec"]
    assert spec["schedules"] == ["0 3 * * MON-FRI"] and "schedule" not in spec
    assert spec["concurrencyPolicy"] == "Forbid" and spec["timezone"] == "Europe/Berlin"
    assert spec["startingDeadlineSeconds"] == 3600
    assert spec["successfulJobsHistoryLimit"] == 3 and spec["failedJobsHistoryLimit"] == 3
    wf = spec["workflowSpec"]
    assert (
        wf["serviceAccountName"] == "moerl-runner" and wf["activeDeadlineSeconds"] > 7 * 24 * 3600
    )
    (tmpl,) = wf["templates"]
    assert wf["entrypoint"] == tmpl["name"]
    c = tmpl["container"]
    assert c["image"] == "registry/moerl-cpu:1.2.3" and c["command"] == ["moerl"]
    assert c["resources"] == {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"memory": "2Gi"},
    }
    assert tmpl["nodeSelector"] == {"moerl.ai/group": "cpu"}
    assert tmpl["tolerations"] == [
        {"key": "moerl.ai/group", "operator": "Equal", "value": "cpu", "effect": "NoSchedule"}
    ]
    args = c["args"]
    assert args[:2] == ["submit", schedule.CONFIG_PATH]
    # each scheduled run reuses the pipeline version while nothing changed
    assert dict(zip(args[2::2], args[3::2])) == {
        "--host": schedule.IN_CLUSTER_KFP,
        "--experiment": "nightly",
        "--run-name": "{{workflow.name}}",
        "--wait-timeout-s": str(7 * 24 * 3600),
        "--namespace": "team-a",
        "--service-account": "moerl-runner",
        "--config-name": "moerl-grpo",
    }
    # the config the step submits: warm start on, no credentials, loadable by `moerl submit`
    (artifact,) = tmpl["inputs"]["artifacts"]
    assert artifact["path"] == schedule.CONFIG_PATH
    assert "s3cret" not in json.dumps(cw) and "alice" not in json.dumps(cw)
    embedded = parse_config(yaml.safe_load(artifact["raw"]["data"]))
    assert (
        embedded.model.warm_start == "previous"
        and embedded.tracking.uri == "http://mlflow.mlflow:5000"
    )
    assert embedded.cluster.groups.cpu.image == "registry/moerl-cpu:1.2.3"


def test_the_schema_check_can_fail():
    cw = schedule.cron_workflow(_cfg(), "@daily")
    _validate(cw)
    bad = copy.deepcopy(cw)
    bad["spec"]["schedules"] = "0 0 * * *"  # not a list
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(bad)
    old = copy.deepcopy(cw)
    old["spec"]["schedule"] = old["spec"].pop("schedules")[0]  # the field Argo v4 removed
    with pytest.raises(jsonschema.ValidationError):
        _validate(old)


def test_cron_workflow_defaults_to_the_base_image_and_utc():
    cw = schedule.cron_workflow(_cfg(pipeline={"base_image": "moerl-cpu:9.9.9"}), "0 30 1 * * *")
    assert cw["spec"]["timezone"] == "UTC" and cw["spec"]["schedules"] == ["30 1 * * *"]
    assert cw["spec"]["workflowSpec"]["templates"][0]["container"]["image"] == "moerl-cpu:9.9.9"
    assert (
        "serviceAccountName" not in cw["spec"]["workflowSpec"] and "namespace" not in cw["metadata"]
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cron": "30 0 3 * * *"}, "cron: field 1 (second) is '30'"),
        ({"cron": "0 0 3 * * *", "timezone": "Nowhere/Town"}, "not an IANA time zone"),
        ({"cron": "0 0 3 * * *", "name": "x" * 53}, "at most 52 characters"),
    ],
)
def test_cron_workflow_refusals(kwargs, message):
    with pytest.raises(ConfigError) as err:
        schedule.cron_workflow(_cfg(), **kwargs)
    assert message in str(err.value)


# ------------------------------------------------------------------------------------ CLI


def _parser():
    p = argparse.ArgumentParser(prog="moerl")
    schedule.add_parsers(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_writes_only_the_cron_workflow_with_no_kfp(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {"checkpoint": {"uri": "s3://bucket/moerl"}, "tracking": {"uri": "http://mlflow:5000"}}
        )
    )
    out = tmp_path / "k8s" / "cron.yaml"
    args = _parser().parse_args(
        [
            "schedule",
            str(tmp_path / "run.yaml"),
            "--cron",
            "0 0 4 * * SUN",
            "--no-kfp",
            "--argo-out",
            str(out),
            "--set",
            "pipeline.iterations=3",
            "--timezone",
            "Asia/Tokyo",
        ]
    )
    assert args.func(args) == 0
    cw = yaml.safe_load(out.read_text())
    _validate(cw)
    assert cw["spec"]["schedules"] == ["0 4 * * SUN"] and cw["spec"]["timezone"] == "Asia/Tokyo"
    embedded = cw["spec"]["workflowSpec"]["templates"][0]["inputs"]["artifacts"][0]["raw"]["data"]
    (tmp_path / "embedded.yaml").write_text(embedded)
    cfg = load_config(tmp_path / "embedded.yaml")  # what `moerl submit` reads in the pod
    assert cfg.pipeline.iterations == 3 and cfg.model.warm_start == "previous"
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        # the cron is checked before the file is read
        (
            [
                "schedule",
                "missing.yaml",
                "--cron",
                "0 0 25 * * *",
                "--no-kfp",
                "--argo-out",
                "x.yaml",
            ],
            "cron: field 3 (hour) must be 0-23, got '25'",
        ),
        (
            ["schedule", "missing.yaml", "--cron", "@daily", "--no-kfp"],
            "--no-kfp: nothing to do without --argo-out",
        ),
        (
            ["schedule", "missing.yaml", "--cron", "@daily", "--timezone", "Bad/Zone"],
            "not an IANA time zone",
        ),
        (
            ["schedule", "missing.yaml", "--cron", "@daily", "--host", "http://u:pw@kfp:8080"],
            "--host: ",
        ),
        (
            [
                "schedule",
                "missing.yaml",
                "--cron",
                "@daily",
                "--no-kfp",
                "--argo-out",
                "x.yaml",
                "--argo-host",
                "http://u:pw@ml-pipeline.kubeflow:8888",
            ],
            "--argo-host: ",
        ),
        (["submit", "missing.yaml", "--host", "https://u:pw@kfp.example"], "--host: "),
    ],
)
def test_cli_refusals(argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = _parser().parse_args(argv)
    with pytest.raises(ConfigError) as err:
        args.func(args)
    assert message in str(err.value) and "pw" not in str(err.value)
    assert not (tmp_path / "x.yaml").exists()


def test_cli_submit_parses_its_flags():
    args = _parser().parse_args(
        [
            "submit",
            "run.yaml",
            "--host",
            "http://kfp:8888",
            "--experiment",
            "e",
            "--run-name",
            "r",
            "--wait-timeout-s",
            "60",
            "--namespace",
            "ns",
            "--param",
            "learning_rate=1e-3",
            "--override",
            "rollout.temperature=0.7",
        ]
    )
    assert (args.host, args.experiment, args.run_name, args.wait_timeout_s, args.namespace) == (
        "http://kfp:8888",
        "e",
        "r",
        60,
        "ns",
    )
    assert args.param == ["learning_rate=1e-3"] and args.override == ["rollout.temperature=0.7"]
    assert schedule._config_name(args) == "run"
    assert args.func is schedule._cmd_submit
