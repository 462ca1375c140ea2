"""KFP component: rollout generation with vLLM."""

from kfp.dsl import Artifact, Output


def rollout(config_json: str, run_id: str, policy_json: str, iteration: int, samples: Output[Artifact]) -> dict:
    """Generate `rollout.samples_per_prompt` samples for each of this iteration's prompts.

    Serves the policy version in `policy_json` (fetched into the node-local checkpoint cache
    and verified against its manifest) with vLLM, and writes one Sample record per line to
    `samples` (JSONL): tokens, the engine's token logprobs, finish reason, policy version.
    Returns the stage's metrics (`timing/rollout_s`, `throughput/rollout_tokens_per_s`, ...).
    """
    from moerl.components.rollout.stage import run_rollout
    from moerl.config import config_from_json
    from moerl.records import PolicyVersion

    return run_rollout(config_from_json(config_json), run_id, PolicyVersion.model_validate_json(policy_json),
                       iteration, samples.path)
