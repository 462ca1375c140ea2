"""The policy models: what a checkpoint is and how it is built, checked and loaded, and the MoE
families moerl trains and serves (`families`: one module each and the registry the trainer,
the engine and preflight ask instead of testing `model_type` strings). moerl/models/README.md.
"""
