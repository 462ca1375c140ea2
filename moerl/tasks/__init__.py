"""What the policy is trained on and how its answers are scored.

- `dataset`: prompt datasets (`{id, task, prompt | messages, answer, meta?}` JSONL): a user's
  file or a shipped one (`builtin:<name>`), validated row by row with malformed rows counted.
- `prompting`: a row's prompt as the engine's token ids (text, or chat messages through the
  tokenizer's template) and each response's token budget.
- `digits`: the shipped digit tasks (copy, reverse, add) and their deterministic generator.
- `verifiers`: rule verifiers (positional, exact), each task's default, the verifier a row's
  task gets (`reward.verifiers`, `reward.verifier`), and `call_verifier`, which runs one in the
  sandbox with `(response, answer, meta)` or `(response, answer)`, plain or async.
- `environments`: the multi-turn interface (`reset(row)`, `step(text)`, by import path in
  `task.environment(s)`) and the functions the pool runs for it; the episode loop that drives
  the engine is `moerl/components/rollout/episodes.py`.
- `sandbox`: the sandboxed execution pool every verifier and environment call runs in (child
  processes with no credentials, a time and a memory limit per call; keyed calls keep an
  episode in one child); `sandbox_child` is the process side, `isolation` the namespaces each
  child runs in (no network, read-only files, no capabilities) and the non-dumpable stage.
- `tools`: the shipped tool environments: `Calculator` (word problems) and `Lookup` (the
  multi-turn task the tiny model learns, `builtin:digits-lookup`).
- `offline`: real tasks with no download (the `moerl[tasks]` extra): reasoning-gym datasets
  (`moerl tasks make`) and the `reasoning_gym` and `math` (math-verify) verifiers.
- `preferences`: preference pairs for reward-model training, and the shipped set.
- `data/`: the shipped files (`builtin:digits-copy`, `builtin:digits-mix`,
  `builtin:digits-lookup`, `builtin:prefs-digits`).

How to bring a task: docs/tasks.md.
"""
