"""moerl: RL post-training (GRPO) for Mixture-of-Experts LLMs as a Kubeflow pipeline."""

__version__ = "0.1.0"
