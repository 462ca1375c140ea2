"""The tiny workload the benchmark tests run: the embedded default config, cut to 8 prompts x 4
samples and 2 optimizer steps per version (the config's KV cache, rollout.kv_cache_gib, is
small enough for several engines on this machine)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs/tiny-moe-grpo.yaml"
SMALL = [
    "task.prompts_per_iteration=8",
    "rollout.samples_per_prompt=4",
    "trainer.optimizer.optimizer_steps_per_iteration=2",
]
