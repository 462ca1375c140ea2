"""What the policy is trained on and how its answers are scored.

- `dataset`: prompt datasets (`{id, task, prompt, answer}` JSONL): a user's file or a shipped
  one (`builtin:<name>`), validated row by row with malformed rows counted.
- `digits`: the shipped digit tasks (copy, reverse, add) and their deterministic generator.
- `verifiers`: rule verifiers (positional, exact) and each task's default.
- `preferences`: preference pairs for reward-model training, and the shipped set.
- `data/`: the shipped files (`builtin:digits-copy`, `builtin:digits-mix`, `builtin:prefs-digits`).

A user's tasks, verifiers and environments (plug-ins, the sandboxed execution pool) go here;
the shipped tasks register the same way a user's would.
"""
