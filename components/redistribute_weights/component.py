"""KFP component: weight redistribution to the rollout engines."""

from typing import NamedTuple


# Its outputs: a NamedTuple(...) call, the form KFP reads them from (mypy takes no call there).
def redistribute_weights(config_json: str, run_id: str, policy_json: str) -> NamedTuple(  # type: ignore[valid-type]
    "Redistributed", [("policy_json", str), ("metrics", dict)]
):
    """Make the version in `policy_json` the one the next rollout serves: fetch it into the
    node-local checkpoint cache, verify it against its manifest, and point `serving.json` at
    it. Returns the PolicyVersion JSON and `timing/redistribute_weights_s`."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("redistribute_weights", config_json)
    from collections import namedtuple

    from moerl.components.redistribute_weights.stage import run_redistribute
    from moerl.config import config_from_json
    from moerl.provenance import stage_start
    from moerl.records import PolicyVersion

    cfg = config_from_json(config_json)
    # build-info and runtime probe on the run
    stage_start(cfg, "redistribute_weights", run_id, enforce=False)
    policy, metrics = run_redistribute(cfg, run_id, PolicyVersion.model_validate_json(policy_json))
    Redistributed = namedtuple("Redistributed", ["policy_json", "metrics"])
    return Redistributed(policy.model_dump_json(), metrics)
