"""Reward scorer (async mode): score generated groups as they arrive, and publish them scored.

Design, details and limitations: docs/async.md#componentsrewardworkerpy.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from pathlib import Path

from moerl.bus import GENERATED, RunBus, TrainerWatch, connect
from moerl.components.reward.stage import ModelScorer, load_model_scorer, open_pool, score
from moerl.config import RewardConfig, RunConfig, config_from_json
from moerl.launch.podenv import enter_pod
from moerl.records import Sample, ScoredSample
from moerl.tasks.sandbox import SandboxPool

log = logging.getLogger(__name__)

BATCH = 16
EXIT_DRAINED = 75


def score_group(
    samples: list[dict],
    cfg: RewardConfig,
    model: ModelScorer | None = None,
    pool: SandboxPool | None = None,
) -> tuple[list[dict], int]:
    """Scored samples (dicts) and how many failed; a raising scorer fails them all."""
    try:
        scored = score([Sample.model_validate(s) for s in samples], cfg, model, pool)
    except Exception as err:  # noqa: BLE001 - counted as failed, never scored 0 silently
        log.error("scoring raised: %s: %s", type(err).__name__, err)
        scored = [
            ScoredSample(
                **s, reward=0.0, reward_failed=True, reward_error=f"{type(err).__name__}: {err}"
            )
            for s in samples
        ]
    return [s.model_dump() for s in scored], sum(s.reward_failed for s in scored)


def score_with_deadline(
    samples: list[dict],
    cfg: RewardConfig,
    model: ModelScorer | None = None,
    keepalive=None,
    every_s: float = 1.0,
    pool: SandboxPool | None = None,
) -> tuple[list[dict], int, bool]:
    """`score_group` in a daemon thread, waited for at most `cfg.timeout_s`. Past it, every
    sample is failed with a timeout error and the third value is True: the thread cannot be
    stopped (a verifier that sleeps or loops forever), so the caller must end the process.
    `keepalive()` is called every `every_s` while it waits (the scorer refreshes its leases).

    Rule verifiers run in `pool` (moerl/tasks/sandbox.py), which cuts each sample off at
    `cfg.sandbox.sample_timeout_s` and `cfg.sandbox.memory_mb` on its own; this deadline is
    the bound on the whole group, reward-model inference included."""
    box: list = []
    t = threading.Thread(
        target=lambda: box.append(score_group(samples, cfg, model, pool)),
        name="moerl-score",
        daemon=True,
    )
    t.start()
    deadline = time.monotonic() + cfg.timeout_s
    while t.is_alive() and (left := deadline - time.monotonic()) > 0:
        t.join(min(left, every_s))
        if keepalive is not None and t.is_alive():
            keepalive()
    if box:
        scored, n_failed = box[0]
        return scored, n_failed, False
    err = f"timeout: scoring took longer than reward.timeout_s {cfg.timeout_s:g} s"
    return (
        [
            ScoredSample(**s, reward=0.0, reward_failed=True, reward_error=err).model_dump()
            for s in samples
        ],
        len(samples),
        True,
    )


def _samples(group: dict) -> None:
    """Raise unless every sample of a generated group parses (the bus dead-letters it then)."""
    for s in group["samples"]:
        Sample.model_validate(s)


def run_reward_scorer(cfg: RunConfig, run_id: str, scorer: str) -> int:
    from moerl.provenance import stage_start

    ref = cfg.reward.model  # set unless kind is rules (RewardConfig)
    on_gpu = cfg.reward.kind != "rules" and ref is not None and ref.device == "cuda"
    stage_start(cfg, scorer, run_id, enforce=on_gpu)  # build-info and runtime probe on the run
    # loaded once for the scorer's life (reward.kind model or mixed)
    model = load_model_scorer(cfg, run_id)
    bus = RunBus(
        connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username),
        run_id,
        cfg.units.visibility_timeout_s,
        cfg.units.max_attempts,
    )
    bus.ensure_groups()
    stop = {"asked": False}
    pool = open_pool(cfg.reward)  # the sandboxed verifier processes, for the scorer's life

    def on_term(signum, frame) -> None:
        stop["asked"] = True

    previous = signal.signal(signal.SIGTERM, on_term)
    t_start, busy = time.perf_counter(), 0.0
    watch = TrainerWatch(bus, cfg.pipeline.trainer_lost_s)
    try:
        while not stop["asked"]:
            bus.heartbeat(scorer, busy_s=busy, wall_s=time.perf_counter() - t_start)
            got = bus.take_generated(scorer, BATCH, block_ms=200, validate=_samples)
            if not got:
                if bus.done() or watch.abandoned():  # abandoned: the run fails through its trainer
                    return 0
                continue
            t0 = time.perf_counter()
            touched = time.monotonic()
            every = bus.visibility_ms / 4000

            def keepalive(rest) -> None:  # a long scoring keeps this group's lease and the batch's
                for eid, _ in rest:
                    bus.touch(GENERATED, scorer, eid)

            for i, (entry_id, group) in enumerate(got):
                scored, n_failed, timed_out = score_with_deadline(
                    group["samples"],
                    cfg.reward,
                    model,
                    keepalive=lambda rest=got[i:]: keepalive(rest),
                    every_s=every,
                    pool=pool,
                )
                errors = [s.get("reward_error") or "" for s in scored]
                bus.publish_scored(
                    entry_id,
                    {**group, "samples": scored},
                    n_failed,
                    sample_timeouts=sum(e.startswith("timeout:") for e in errors),
                    sample_memory=sum(e.startswith("memory:") for e in errors),
                )
                # its thread still runs: restart clean; the rest of the batch is reclaimed
                if timed_out:
                    bus.incr(score_timeouts=len(scored))
                    log.error(
                        "%s: scoring group %s took longer than reward.timeout_s %g s; marked failed, "
                        "restarting",
                        scorer,
                        group["group_id"],
                        cfg.reward.timeout_s,
                    )
                    return EXIT_DRAINED
                # the rest of the batch stays ours
                if time.monotonic() - touched > bus.visibility_ms / 4000:
                    for eid, _ in got[i + 1 :]:
                        bus.touch(GENERATED, scorer, eid)
                    touched = time.monotonic()
            busy += time.perf_counter() - t0
        return EXIT_DRAINED
    finally:
        signal.signal(signal.SIGTERM, previous)
        pool.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--name", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {a.name} %(levelname)s %(message)s"
    )
    text = Path(a.config).read_text()
    cfg = config_from_json(text)
    # as the component does: the process's own scratch when pod-shaped, and in a sandbox given
    # the cluster's Secrets, its pod's credentials and no others
    enter_pod("reward_scorer", text)
    return run_reward_scorer(cfg, a.run_id, a.name)


if __name__ == "__main__":
    sys.exit(main())
