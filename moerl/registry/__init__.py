"""MLflow's model registry: the trained policy (`policy`: registered at the end of a run, a
warm start from a registered version) and reward models (`reward_model`: registered by the
reward-model pipeline, found and fetched by a GRPO run). Below the stages that register and
read them, so the run's preflight checks a registered version before any work.
"""
