"""What the policy is trained on and how its answers are scored.

- `dataset`: prompt datasets (`{id, task, prompt | messages, answer, meta?}` JSONL): a user's
  file or a shipped one (`builtin:<name>`), validated row by row with malformed rows counted.
- `prompting`: a row's prompt as the engine's token ids (text, or chat messages through the
  tokenizer's template) and each response's token budget.
- `digits`: the shipped digit tasks (copy, reverse, add) and their deterministic generator.
- `verifiers`: rule verifiers (positional, exact), each task's default, the verifier a row's
  task gets (`reward.verifiers`, `reward.verifier`), and `call_verifier`, which runs one in the
  sandbox with `(response, answer, meta)` or `(response, answer)`, plain or async.
- `sandbox`: the sandboxed execution pool every verifier call runs in (child processes with no
  credentials, a time and a memory limit per call).
- `preferences`: preference pairs for reward-model training, and the shipped set.
- `data/`: the shipped files (`builtin:digits-copy`, `builtin:digits-mix`, `builtin:prefs-digits`).

A user's tasks and environments (plug-ins beyond a verifier function) go here too; the
shipped verifiers are called through the same pool a user's are.
"""
