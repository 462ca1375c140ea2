"""The preflight on a group's size on the bus (moerl/bus/sizes.py): R3 routes at the seed's scale
make groups the producer refuses (over MAX_ENTRY_BYTES), every one; before, nothing refused such
a config and the run generated for ever without training."""

from __future__ import annotations

from pathlib import Path

import pytest

from moerl.bus.scripts import MAX_ENTRY_BYTES
from moerl.bus.sizes import check_group_size, group_bytes
from moerl.config import load_config
from moerl.errors import ConfigError
from moerl.models.sizes import SEED_CONFIGS
from moerl.preflight import preflight, route_bytes

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str):
    base = ["reward.timeout_s=600"]
    return load_config(ROOT / "configs/tiny-moe-grpo.yaml", [*base, *overrides], mode="async")


def test_r3_routes_of_qwen3_235b_at_the_seeds_lengths_are_refused_naming_the_keys():
    routes, why = route_bytes(SEED_CONFIGS["Qwen3-235B-A22B"])
    assert (routes, why) == (752, "94 MoE layers x top-8 x 1 B a token")
    cfg = _cfg("rollout.samples_per_prompt=16", "rollout.max_new_tokens=8192")
    assert group_bytes(cfg, routes) > 2 * MAX_ENTRY_BYTES  # about 128 MiB
    with pytest.raises(ConfigError) as err:
        check_group_size(cfg, routes, why)
    line = str(err.value)
    assert "over its entry cap of 64 MiB" in line
    for key in ("rollout.samples_per_prompt 16", "rollout.max_new_tokens 8192", "94 MoE layers"):
        assert key in line, line
    assert err.value.exit_code == 2
    # without routes, the same lengths fit: the check refuses what the bus would, not more
    check_group_size(cfg, 0)


def test_preflight_refuses_such_a_run_before_any_work():
    cfg = _cfg(
        "rollout.samples_per_prompt=16",
        "rollout.max_new_tokens=1000000",
        "rollout.return_routed_experts=true",
        "rollout.engine_in_process=true",
    )
    with pytest.raises(ConfigError, match="rollout.max_new_tokens 1000000"):
        preflight(cfg)
