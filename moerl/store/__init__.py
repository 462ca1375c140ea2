"""Where policy versions live: the checkpoint store, its backends, and the node-local cache.

Design, details and limitations: docs/weights.md#moerlstore__init__py.
"""
