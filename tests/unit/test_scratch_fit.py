"""The pods' scratch against the model (moerl/preflight.py `check_scratch`): a run whose node
cache, trainer state or hub download outgrows a task's scratch emptyDir is refused before any
work, naming the keys and the GB; the GPU groups' NVMe-sized default holds the seed's models."""

from __future__ import annotations

import json

import pytest

from moerl.config import parse_config
from moerl.config.cluster import quantity_bytes
from moerl.errors import ConfigError
from moerl.models.sizes import SEED_CONFIGS, model_sizes
from moerl.preflight import check_scratch, scratch_needs

QWEN3_235B = SEED_CONFIGS["Qwen3-235B-A22B"]
ON_ROOT = {"scratch_size": None}  # the group falls back to cluster.scratch_size (200Gi)


def _cfg(mode="async", groups=None, **over):
    data = {
        "checkpoint": {"uri": "s3://moerl-ckpt/prod"},
        "pipeline": {"mode": mode},
        "rollout": {"device": "cuda"},
        "trainer": {
            "parallelism": {"device": "cuda", "data_parallel_shard": 4, "expert_parallel_size": 8}
        },
        "cluster": {"launch": {"mode": "kubernetes"}, "groups": groups or {}},
    }
    for section, values in over.items():
        data.setdefault(section, {}).update(values)
    return parse_config(data)


def test_the_seed_config_has_qwen3_235b_a22bs_published_shapes():
    hf = QWEN3_235B
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (4096, 94, 151936)
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"]) == (
        128,
        8,
        1536,
    )
    assert (hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (64, 4, 128)
    assert 235.0e9 < model_sizes(hf).total_params < 235.2e9  # 235B: 470 GB in bf16


def test_qwen3_235b_on_the_200gi_scratch_is_refused_naming_the_keys_and_figures():
    cfg = _cfg(groups={"rollout": ON_ROOT, "trainer": ON_ROOT})
    with pytest.raises(ConfigError) as e:
        check_scratch(cfg, QWEN3_235B)
    msg = str(e.value)
    for part in (
        # the rollout pod's node cache: cache_keep + 1 copies of the bf16 engine weights
        "3 versions (checkpoint.cache_keep 2 + 1) of 470.2 GB of engine weights "
        "(rollout.dtype bfloat16) needs 1,410.6 GB, more than the 214.7 GB of "
        "cluster.scratch_size 200Gi",
        "allowed: cluster.groups.rollout.scratch_size of at least 1314Gi",
        "or lower checkpoint.cache_keep",
        # a trainer node: 1/4 of 3 versions, 2 of them with 2.8 TB of float32 master weights and
        # Adam (4 trainer nodes: checkpoint.state_every resolves to keep_last 3)
        "a trainer node: 1/4 of 3 versions (checkpoint.max_unpublished 1 + 2)",
        "2 of them with 2,821.1 GB of master weights and Adam (model.dtype float32) "
        "needs 1,763.2 GB",
        "cluster.groups.trainer.scratch_size of at least 1643Gi",
    ):
        assert part in msg, (part, msg)
    assert e.value.exit_code == 2  # the CLI and start_run exit non-zero with it
    # cache_keep 1 still needs 2 copies (the one fetched and the served one): still refused
    with pytest.raises(ConfigError, match=r"2 versions \(checkpoint.cache_keep 1 \+ 1\)"):
        check_scratch(
            _cfg(groups={"rollout": ON_ROOT}, checkpoint={"cache_keep": 1}),
            QWEN3_235B,
        )


def test_qwen3_235b_fits_the_gpu_groups_nvme_sized_default():
    cfg = _cfg()
    assert cfg.cluster.scratch_of(cfg.cluster.groups.rollout) == "16Ti"
    needs = {n.group: n for n in check_scratch(cfg, QWEN3_235B)}
    assert set(needs) == {"rollout", "trainer"}  # an S3 model: no download on the buffer group
    assert needs["rollout"].key == "cluster.groups.rollout.scratch_size 16Ti"
    assert needs["rollout"].need == 3 * 470_185_672_704 and needs["rollout"].limit == 16 * 2**40
    assert needs["trainer"].fits and needs["trainer"].need < needs["trainer"].limit
    # a node cache kept deeper than the NVMe holds is refused all the same
    with pytest.raises(ConfigError, match="checkpoint.cache_keep 40 \\+ 1"):
        check_scratch(_cfg(checkpoint={"cache_keep": 40}), QWEN3_235B)


def test_a_hub_model_downloads_on_the_buffer_group_and_sync_redistributes_there():
    hub = _cfg(model={"path": "hf://Qwen/Qwen3-235B-A22B@" + "0" * 40})
    with pytest.raises(ConfigError) as e:
        check_scratch(hub, QWEN3_235B)
    assert "init_policy: the hub model hf://Qwen/Qwen3-235B-A22B@" in str(e.value)
    assert "needs 470.2 GB, more than the 214.7 GB of cluster.scratch_size 200Gi" in str(e.value)
    assert "or stage it in S3" in str(e.value)
    # its own buffer scratch, or S3 (copied server-side): fits
    roomy = {"buffer": {"scratch_size": "1Ti"}}
    assert all(
        n.fits
        for n in check_scratch(
            _cfg(groups=roomy, model={"path": "hf://Qwen/Qwen3-235B-A22B@" + "0" * 40}),
            QWEN3_235B,
        )
    )
    # sync: one version per rollout task, and redistribute_weights fetches one on the buffer group
    sync = {n.what.split(":")[0]: n for n in scratch_needs(_cfg("sync"), QWEN3_235B)}
    assert sync["a rollout task"].need == 470_185_672_704 and sync["a rollout task"].fits
    assert not sync["redistribute_weights"].fits
    with pytest.raises(ConfigError, match="redistribute_weights.*or pipeline.mode async"):
        check_scratch(_cfg("sync"), QWEN3_235B)


def test_the_tiny_default_fits():
    from moerl.models.tiny import tiny_hf_config, tiny_vocab

    cfg = parse_config({})
    hf = tiny_hf_config(cfg.model.tiny, len(tiny_vocab()), 0, 1, 2).to_dict()
    needs = check_scratch(cfg, hf)
    assert needs and all(n.fits and n.need < 10**8 for n in needs)  # MB, not GB
    # and on a scratch smaller than the tiny model, refused all the same
    tiny_scratch = {"cluster": {"groups": {"trainer": {"scratch_size": "1Ki"}}}}
    with pytest.raises(ConfigError, match="cluster.groups.trainer.scratch_size 1Ki"):
        check_scratch(parse_config(tiny_scratch), hf)


def test_preflight_reads_the_models_config_and_refuses_before_work(tmp_path):
    from moerl.preflight import _check_scratch

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_235B))
    cfg = _cfg(groups={"rollout": ON_ROOT})
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(tmp_path)})})
    with pytest.raises(ConfigError, match="a rollout pod's node cache: 3 versions"):
        _check_scratch(cfg)


@pytest.mark.parametrize(
    ("quantity", "n"),
    [("200Gi", 200 * 2**30), ("16Ti", 16 * 2**40), ("500G", 500 * 10**9), ("1024", 1024)],
)
def test_quantity_bytes(quantity, n):
    assert quantity_bytes(quantity) == n
