"""KFP component: GRPO policy update."""

from kfp.dsl import Artifact, Input, Output


def policy_update(config_json: str, batch: Input[Artifact], state_in: Input[Artifact], iteration: int,
                  state_out: Output[Artifact]) -> dict:
    """Run `trainer.optimizer_steps_per_iteration` GRPO steps on `batch`.

    `state_in` / `state_out` are trainer-state directories: `model/` (HF checkpoint) and
    `trainer/` (optimizer state, counters). Non-finite losses skip their step and are
    counted; `trainer.max_consecutive_skipped_steps` in a row fail the run.
    Returns `train/*` metrics and `timing/policy_update_s`.
    """
    from moerl.components.policy_update.trainer import run_policy_update
    from moerl.config import config_from_json

    return run_policy_update(config_from_json(config_json), batch.path, state_in.path, state_out.path, iteration)
