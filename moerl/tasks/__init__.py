"""What the policy is trained on and how its answers are scored.

Design, details and limitations: docs/tasks.md#module-notes.
"""
