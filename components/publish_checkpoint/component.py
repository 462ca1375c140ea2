"""KFP components: publish the initial policy (version 0), or name the version a resumed run
continues from. Each later version is published by the policy update that trains it."""


def init_policy(config_json: str, run_id: str, stages_beside: bool = False) -> str:
    """Build version 0 (the tiny model from its seed, or a copy of `model.path`; with
    `model.warm_start: previous`, the verified final checkpoint of the newest FINISHED run in
    `tracking.experiment`, recorded in this run's `moerl.warm_start.*` tags), publish it to the
    checkpoint store, and return its PolicyVersion as JSON: what the first policy update starts
    from (it reads the version from the store). `stages_beside` (the async pipeline, whose rollout
    workers and scorers start beside this task): a failure also marks the run failed on its
    Valkey bus, so they stop at once."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("init_policy", config_json)
    import tempfile

    from moerl.components.publish_checkpoint.stage import publish_initial
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    try:
        # build-info and runtime probe on the run
        stage_start(cfg, "init_policy", run_id, enforce=False)
        with tempfile.TemporaryDirectory(prefix="moerl-v0-") as state:
            policy, _ = publish_initial(cfg, run_id, state)
    except BaseException as err:
        if stages_beside and cfg.valkey.url:
            from moerl.bus import abandon_run

            abandon_run(
                cfg.valkey.url,
                cfg.valkey.username,
                run_id,
                f"init_policy failed: {type(err).__name__}: {err}"[:2000],
            )
        raise
    return policy.model_dump_json()


def resume_policy(config_json: str, run_id: str, version: int) -> str:
    """Continue run `run_id` from its published `version`: check that the durable store holds
    it with the trainer's state (optimizer, counters; version 0 needs none), and return its
    PolicyVersion as JSON. The policy update reads it from the store itself."""
    from moerl.launch.podenv import enter_pod

    # the pod's scratch: cwd, HOME, TMPDIR (moerl/launch/podenv.py)
    enter_pod("resume_policy", config_json)
    from moerl.components.publish_checkpoint.stage import resumable
    from moerl.config import config_from_json
    from moerl.provenance import stage_start

    cfg = config_from_json(config_json)
    # build-info and runtime probe on the run
    stage_start(cfg, "resume_policy", run_id, enforce=False)
    return resumable(cfg, run_id, version).model_dump_json()
