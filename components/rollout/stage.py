"""Rollout stage: G samples per prompt from the policy version the engines serve.

Steps: (1) pick this iteration's prompts from the dataset cursor; (2) make sure the policy
version is in the local checkpoint cache (verified against its manifest); (3) start vLLM on
it; (4) generate, or, with an environment (`task.environment`), run multi-turn episodes token
in and token out (`episodes.py`, environments in the sandboxed pool); (5) write one `Sample`
per completion or episode, each carrying the engine's token logprobs, finish reason and policy
version.
"""

from __future__ import annotations

import time
from pathlib import Path

from moerl.components.rollout.episodes import (
    EpisodeDriver,
    env_pool,
    run_episodes,
    uses_environments,
)
from moerl.config import RunConfig
from moerl.records import PolicyVersion, Sample, write_records
from moerl.store.runs import engine_copy
from moerl.tasks.dataset import load_dataset
from moerl.tasks.prompting import encode_prompt, uses_template
from moerl.tracking import check_pinned


def to_samples(
    prompts, prompt_ids: list[list[int]], completions, version: int, engine=None
) -> list[Sample]:
    """One Sample per completion: prompt i's completions (`RolloutEngine.generate` order) with
    its token ids, sample index j within the group, made by policy `version`; with the
    engine's routes when it recorded them (`rollout.return_routed_experts`)."""
    return [
        Sample(
            prompt_id=p.id,
            task=p.task,
            prompt=p.prompt_text,
            answer=p.answer,
            sample_index=j,
            prompt_token_ids=ids,
            response_token_ids=c.token_ids,
            response_logprobs=c.logprobs,
            response_text=c.text,
            finish_reason=c.finish_reason,
            policy_version=version,
            meta=p.meta,
            routed_experts=engine.routed_experts(c) if engine is not None else None,
        )
        for p, ids, comps in zip(prompts, prompt_ids, completions)
        for j, c in enumerate(comps)
    ]


def run_rollout(
    cfg: RunConfig, run_id: str, policy: PolicyVersion, iteration: int, out_path: str | Path
) -> dict[str, float]:
    from transformers import AutoTokenizer

    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.transport import check_engine_transport
    from moerl.provenance import stage_start

    stage_start(cfg, "rollout", run_id)  # records where it runs; enforces `require:`
    t0 = time.perf_counter()
    # 1. prompts
    ds = load_dataset(cfg.task.dataset, cfg.task.max_bad_fraction, cfg.checkpoint)
    check_pinned(ds, cfg, run_id)  # the shards the run started on, not rewritten since
    prompts = ds.batch(iteration, cfg.task.prompts_per_iteration, cfg.task.shuffle_seed)
    # 2. weights, from the verified local cache
    with engine_copy(
        cfg.checkpoint,
        run_id,
        policy.version,  # held while it loads; exactly the published manifest
        expect_sha256=policy.manifest_sha256,
    ) as model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # text, or chat template
        prompt_ids = [encode_prompt(tokenizer, cfg.rollout, p) for p in prompts]
        # 3-4. engine and generation; the seed varies per iteration so groups differ across iterations
        engine = RolloutEngine(model_dir, cfg.rollout, seed=cfg.rollout.seed + iteration)
        try:  # the transport it got, recorded; `require:` refuses a silent fallback
            check_engine_transport(cfg, engine.core.vllm_config, run_id)
        except Exception:
            engine.close()
            raise
    t_gen = time.perf_counter()
    extra: dict[str, float] = {}
    # multi-turn: one request per episode per turn, environments in the sandbox
    if uses_environments(cfg):
        with env_pool(cfg) as pool:
            driver = EpisodeDriver(cfg, tokenizer, pool)
            has = bool(getattr(tokenizer, "chat_template", None))
            eps = [
                driver.episode(
                    f"i{iteration}-{i}-{j}",
                    p.model_dump(),
                    ids,
                    j,
                    uses_template(has, cfg.rollout, p),
                )
                for i, (p, ids) in enumerate(zip(prompts, prompt_ids))
                for j in range(cfg.rollout.samples_per_prompt)
            ]
            gen_s = run_episodes(engine, driver, eps)
            extra = driver.metrics(eps, time.perf_counter() - t_gen)
        samples = [e.sample(policy.version) for e in eps]
    else:
        completions = engine.generate(prompt_ids, cfg.rollout.samples_per_prompt)
        gen_s = time.perf_counter() - t_gen
        samples = to_samples(prompts, prompt_ids, completions, policy.version, engine)
    if engine.capture is not None:  # positions before the last that the capture missed (expected 0)
        extra["rollout/routes_missing_fraction"] = engine.capture.missing_slots / max(
            engine.capture.slots, 1
        )
    engine.close()
    # 5. records
    write_records(out_path, samples)
    n_tokens = sum(len(s.response_token_ids) for s in samples)
    return extra | {
        "timing/rollout_s": time.perf_counter() - t0,
        "rollout/engine_load_s": engine.load_s,
        "rollout/generate_s": gen_s,
        "throughput/rollout_tokens_per_s": n_tokens / max(gen_s, 1e-9),
        "rollout/samples": float(len(samples)),
        "response/length_mean": n_tokens / max(len(samples), 1),
        "rollout/truncated_fraction": sum(s.finish_reason == "length" for s in samples)
        / max(len(samples), 1),
        "data/bad_rows": float(ds.bad_rows),
        "policy/version": float(policy.version),
    }
