"""What the policy is trained on and how its answers are scored.

- `dataset`: prompt datasets (`{id, task, prompt, answer}` JSONL): a user's file or a shipped
  one (`builtin:<name>`), validated row by row with malformed rows counted.
- `digits`: the shipped digit tasks (copy, reverse, add) and their deterministic generator.
- `verifiers`: rule verifiers (positional, exact), each task's default, and the import path a
  verifier is called by (a shipped one, or a user's `package.module:function`).
- `sandbox`: the sandboxed execution pool every verifier call runs in (child processes with no
  credentials, a time and a memory limit per call).
- `preferences`: preference pairs for reward-model training, and the shipped set.
- `data/`: the shipped files (`builtin:digits-copy`, `builtin:digits-mix`, `builtin:prefs-digits`).

A user's tasks and environments (plug-ins beyond a verifier function) go here too; the
shipped verifiers are called through the same pool a user's are.
"""
