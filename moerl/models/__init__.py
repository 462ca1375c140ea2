"""The policy models: what a checkpoint is and how it is built, checked and loaded.

- `policy`: a user's HF checkpoint checked before any work (`check_checkpoint`), version 0 of
  a run (`initial_checkpoint`), and `load_policy` for training.
- `tiny`: the embedded default, a tiny random-init Qwen3-MoE (or Mixtral-style) model with a
  character-level tokenizer, built from a seed so that no hub download is ever needed.

Model-family code goes here, one module per family (`<family>.py`: the HF class, where the MoE
block and its router sit, shared experts, how checkpoint keys map to the sharded layout), as in
torchtitan's `models/<family>/`. These files hold the architecture, not the training
infrastructure: the trainer's parallelism stays in `components/policy_update/` and asks the
family's adapter instead of testing `model_type` strings itself.
"""
