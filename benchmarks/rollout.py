"""`moerl bench rollout`: the async rollout worker's output tokens/s against a bare vLLM engine
generating the same prompts, side by side in one run.

Design, details and limitations: docs/bench-reports/rollout.md#how-it-works-benchmarksrolloutpy.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypedDict

from benchmarks import (
    child_main,
    envelope,
    format_table,
    log_tail,
    run_child,
    unit_prompts,
    write_report,
)
from moerl.config import RunConfig, load_config
from moerl.errors import ConfigError

RUN_ID = "bench-rollout"
SWAP_ENV = "MOERL_BENCH_SWAP_EVERY"  # the worker arm's --swap-every, to its child process
SWAP_VERSIONS = 40  # versions published before a swapping arm's window (its swaps stop after these)
WARMUP_ENV = "MOERL_BENCH_WARMUP_UNITS"  # --warmup-units, to each arm's child process
# Units generated before every arm's window, other prompts than the timed ones: a fresh engine's
# first batches pay one-time costs (measured on the embedded default: the first generate of 12
# units took 3.4 s, the same call again 1.25 s), which a long-lived worker pays once per run.
WARMUP_UNITS = 2
POLL_S = 0.25  # the worker arm's poll for its last group (the window's end is read from the bus, not the poll)
WORKLOADS = ("digits", "long-tail")
UPDATES = ("between_units", "in_flight")
# the long-tail workload: room for long responses, ended by the random model's EOS rate
# the KV cache for a full running batch at full length twice over (256 x 512 tokens x 1 KiB x 2)
LONG_TAIL = (
    "model.tiny.max_position_embeddings=512",
    "rollout.max_new_tokens=384",
    "rollout.kv_cache_gib=0.25",
)


class _Window(TypedDict, total=False):
    """The worker arm's timed window, as its feeder thread fills it in."""

    start: dict[str, int]  # the bus counters the warm-up left, subtracted at the end
    t0: float  # Unix s: the window opens
    t1: float  # Unix s: the server added the last group
    busy: float  # the worker's busy seconds within the window
    writes: list[int]  # the window's (bus writes, round trips)


def _localized(cfg: RunConfig, work: Path) -> RunConfig:
    work.mkdir(parents=True, exist_ok=True)
    return cfg.model_copy(
        update={
            "checkpoint": cfg.checkpoint.model_copy(
                update={"uri": str(work / "ckpt"), "cache_dir": str(work / "cache")}
            ),
            "pipeline": cfg.pipeline.model_copy(update={"work_dir": str(work / "work")}),
            "valkey": cfg.valkey.model_copy(update={"url": None}),
        }
    )


def _warm_units() -> int:
    return int(os.environ.get(WARMUP_ENV, str(WARMUP_UNITS)))


def _bare(cfg: RunConfig, n_units: int, work: Path) -> dict[str, Any]:
    """One engine, every prompt in one `generate` call, after the warm-up units' own call."""
    from transformers import AutoTokenizer

    from moerl.components.publish_checkpoint.stage import prepare_initial
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.tasks.prompting import encode_prompt

    cfg = _localized(cfg, work)
    model_dir = work / "v0"
    prepare_initial(cfg, model_dir, run_id=RUN_ID)
    tok = AutoTokenizer.from_pretrained(model_dir)
    warm = _warm_units()
    units = unit_prompts(cfg, n_units + warm)
    ids = [
        encode_prompt(tok, cfg.rollout, p.model_dump()) for unit in units[:n_units] for p in unit
    ]
    warm_ids = [
        encode_prompt(tok, cfg.rollout, p.model_dump()) for unit in units[n_units:] for p in unit
    ]
    engine = RolloutEngine(model_dir, cfg.rollout, seed=cfg.rollout.seed)
    try:
        # the engine's first batches pay one-time costs (kernels for new shapes): not timed
        if warm_ids:
            engine.generate(warm_ids, cfg.rollout.samples_per_prompt)
        t0 = time.perf_counter()
        groups = engine.generate(ids, cfg.rollout.samples_per_prompt)
        wall = time.perf_counter() - t0
    finally:
        engine.close()
    lengths = sorted(len(c.token_ids) for g in groups for c in g)
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {
        "tokens": sum(lengths),
        "groups": len(groups),
        "wall_s": wall,
        "load_s": engine.load_s,
        "warmup_units": warm,
        "busy_fraction": 1.0,
        "length_p50": pick(0.5),
        "length_p90": pick(0.9),
        "length_p99": pick(0.99),
        "length_max": lengths[-1],
    }


BREAKDOWN = ("generate", "loop", "loop+seeds", "loop+samples", "loop+samples+bus")
BREAKDOWN_ROUNDS = 3


def _breakdown(cfg: RunConfig, n_units: int, work: Path) -> dict[str, Any]:
    """Where the worker's time goes, on ONE engine in one process: the same engine generates
    `n_units` fresh units per window, driven each of these ways in turn, round after round
    (interleaved, so the machine's slow stretches hit every way alike):

    - generate: one `generate` call (the prompts encoded inside the window, as the worker does);
    - loop: the worker's driving, `submit` per prompt (n = G) and `step`, the next unit
      submitted whenever fewer than twice max_num_seqs sequences are unfinished;
    - loop+seeds: the same with a seed per group (`rollout.seed_groups`);
    - loop+samples: the loop, each finished group made into its samples (`group_samples`);
    - loop+samples+bus: and each step's groups written to a real Valkey through the worker's
      outbox (`RunBus.group_write`, `_Outbox`, pipelined), flushed before the window ends.

    Each way's tokens/s and its median ratio to `generate` over the rounds; what the worker adds
    beyond the last (leasing, acknowledgements, heartbeats, version checks) is the gap between
    it and the worker arms."""
    from transformers import AutoTokenizer

    from moerl.bus import RunBus, connect, group_id
    from moerl.components.publish_checkpoint.stage import prepare_initial
    from moerl.components.rollout.engine import RolloutEngine
    from moerl.components.rollout.worker import _Outbox, group_samples, group_seed
    from moerl.orchestrate.async_run import start_valkey
    from moerl.tasks.prompting import encode_prompt

    cfg = _localized(cfg, work)
    cfg, server = start_valkey(cfg, work, RUN_ID)
    assert server is not None and cfg.valkey.url  # _localized unset valkey.url: always embedded
    outbox = None
    try:
        bus = RunBus(connect(cfg.valkey.url, 30.0, cfg.valkey.username, server.password), RUN_ID)
        bus.ensure_groups()
        outbox = _Outbox("bench", bus)
        model_dir = work / "v0"
        prepare_initial(cfg, model_dir, run_id=RUN_ID)
        tok = AutoTokenizer.from_pretrained(model_dir)
        G, room = cfg.rollout.samples_per_prompt, cfg.rollout.max_num_seqs
        warm = _warm_units()
        units = unit_prompts(cfg, warm + n_units * len(BREAKDOWN) * BREAKDOWN_ROUNDS)
        engine = RolloutEngine(model_dir, cfg.rollout, seed=cfg.rollout.seed)
        taken = [0]

        def take(n: int) -> list[list]:
            got = units[taken[0] : taken[0] + n]
            taken[0] += n
            return got

        def generate(window: list[list]) -> int:
            ids = [encode_prompt(tok, cfg.rollout, p.model_dump()) for u in window for p in u]
            return sum(len(c.token_ids) for g in engine.generate(ids, G) for c in g)

        def loop(
            window: list[list], seeds: bool = False, samples: bool = False, publish: bool = False
        ) -> int:
            tokens, pending, prompts = 0, list(enumerate(window)), {}
            while pending or engine.unfinished():
                if pending and engine.unfinished_sequences() < 2 * room:
                    i, unit = pending.pop(0)
                    for k, p in enumerate(unit):
                        rid, d = f"w{taken[0]}-{i}-{k}", p.model_dump()
                        prompts[rid] = (
                            d,
                            encode_prompt(tok, cfg.rollout, d),
                            group_id(f"u{i}", k, d["id"]),
                        )
                        engine.submit(
                            rid,
                            prompts[rid][1],
                            G,
                            seed=group_seed(cfg.rollout.seed, f"u{i}", k) if seeds else None,
                        )
                writes = []
                for rid, comps in engine.step():
                    tokens += sum(len(c.token_ids) for c in comps)
                    if samples:
                        d, ids, gid = prompts.pop(rid)
                        dumped = group_samples(RUN_ID, gid, d, ids, comps, 0)
                        if publish:
                            writes.append(bus.group_write(gid, dumped))
                if writes:
                    outbox.put(writes)
            if publish:
                outbox.flush()
            return tokens

        ways = {
            "generate": generate,
            "loop": loop,
            "loop+seeds": lambda w: loop(w, seeds=True),
            "loop+samples": lambda w: loop(w, samples=True),
            "loop+samples+bus": lambda w: loop(w, samples=True, publish=True),
        }
        try:
            if warm:
                generate(take(warm))
            tps: dict[str, list[float]] = {k: [] for k in BREAKDOWN}
            for _ in range(BREAKDOWN_ROUNDS):
                for name in BREAKDOWN:
                    window = take(n_units)
                    t0 = time.perf_counter()
                    n = ways[name](window)
                    tps[name].append(n / (time.perf_counter() - t0))
        finally:
            engine.close()
        out = {}
        for name in BREAKDOWN:
            ratios = [t / g for t, g in zip(tps[name], tps["generate"])]
            out[name] = {
                "tokens_per_s": statistics.median(tps[name]),
                "tokens_per_s_rounds": tps[name],
                "ratio_rounds": ratios,
                "ratio_to_generate": statistics.median(ratios),
            }
        return {
            "ways": out,
            "rounds": BREAKDOWN_ROUNDS,
            "units_per_window": n_units,
            "warmup_units": warm,
            "load_s": engine.load_s,
            "bus_writes": outbox.writes,
            "bus_round_trips": outbox.round_trips,
        }
    finally:
        if outbox is not None:
            outbox.close()
        if server is not None:
            server.stop()


def _prepublish(cfg: RunConfig, work: Path, count: int) -> list[tuple[int, str, str]]:
    """Versions 1..count (version 0's weights under each number), published durably before the
    timed window, as (version, uri, manifest sha256): the window then only registers them, as a
    trainer's commit does, and no publishing work competes with the engine in this process."""
    from moerl.components.publish_checkpoint.stage import prepare_initial, run_publish

    state = work / "publisher-state"
    prepare_initial(cfg, state, run_id=RUN_ID)
    # every version stays until the window registers it (retention would prune the early ones)
    cfg = cfg.model_copy(
        update={"checkpoint": cfg.checkpoint.model_copy(update={"keep_last": count + 1})}
    )
    out = []
    for v in range(1, count + 1):
        policy, _ = run_publish(cfg, RUN_ID, state, v)
        out.append((v, policy.uri, policy.manifest_sha256))
    return out


def _releaser(
    bus, versions: list[tuple[int, str, str]], every_s: float, stop: threading.Event
) -> None:
    """Register the next version every `every_s` seconds until stopped or out of versions."""
    for v, uri, sha in versions:
        if stop.wait(every_s):
            return
        bus.register(v, uri, sha)


def _wait_units_done(bus, n: int, failed: list[BaseException], timeout_s: float = 120.0) -> None:
    """Until the bus counts `n` units acknowledged (or the arm failed)."""
    deadline = time.monotonic() + timeout_s
    while bus.counters()["units_done"] < n and not failed:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the rollout worker acknowledged fewer than {n} units in {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def _worker(cfg: RunConfig, n_units: int, work: Path, swap_every: float = 0.0) -> dict[str, Any]:
    """The real rollout worker on an embedded Valkey; units issued once its engine is loaded;
    `swap_every` > 0: a new version (published before the window) registered every that many
    seconds while it runs."""
    from moerl.bus import GENERATED, RunBus, connect
    from moerl.components.rollout.worker import RolloutWorker
    from moerl.orchestrate.async_run import publish_initial, start_valkey
    from moerl.store.runs import run_store, version_uri

    cfg = _localized(cfg, work)
    cfg, server = start_valkey(cfg, work, RUN_ID)
    assert server is not None and cfg.valkey.url  # _localized unset valkey.url: always embedded
    try:
        publish_initial(cfg, RUN_ID, work)
        bus = RunBus(
            connect(cfg.valkey.url, 30.0, cfg.valkey.username, server.password),
            RUN_ID,
            cfg.units.visibility_timeout_s,
            cfg.units.max_attempts,
        )
        bus.ensure_groups()
        store = run_store(cfg.checkpoint, RUN_ID)
        bus.register(0, version_uri(store, 0), store.manifest(0).sha256())
        bus.trainer_beacon(ttl_s=3600)  # no trainer here: the worker must not abandon the run
        versions = _prepublish(cfg, work, SWAP_VERSIONS) if swap_every > 0 else []
        worker = RolloutWorker(cfg, RUN_ID, "rollout-0", bus)
        warm = _warm_units()
        every = unit_prompts(cfg, n_units + warm)
        units, warm_units = every[:n_units], every[n_units:]
        warm_groups = sum(len(u) for u in warm_units)
        target = warm_groups + sum(len(u) for u in units)
        timed = _Window()
        failed: list[BaseException] = []
        stop = threading.Event()

        def feed() -> None:
            try:
                while worker.engine is None or worker.version is None:
                    time.sleep(0.05)
                for u in warm_units:  # through the whole worker, before the window (see _bare)
                    bus.issue_unit([p.model_dump() for p in u])
                while bus.counters()["groups_generated"] < warm_groups and not failed:
                    time.sleep(0.02)
                busy0 = worker.busy_s
                # the warm-up's writes (its acknowledgements come after its last groups) all
                # counted before the window opens, so the window's count is exactly its own
                _wait_units_done(bus, warm, failed)
                writes0 = worker.settled_bus_writes()
                counters = bus.counters()  # the warm-up's share, subtracted at the end
                timed["start"] = {k: counters[k] for k in ("tokens_generated", "units_overlapped")}
                timed["t0"] = time.time()
                for u in units:
                    bus.issue_unit([p.model_dump() for p in u])
                if swap_every > 0:
                    threading.Thread(
                        target=_releaser,
                        args=(bus, versions, swap_every, stop),
                        name="bench-release",
                        daemon=True,
                    ).start()
                # polled rarely (each poll is a round trip and a thread on the worker's cores); the
                # window ends when the server added the last group (its stream entry's time, 1 ms)
                while bus.counters()["groups_generated"] < target and not failed:
                    time.sleep(POLL_S)
                timed["busy"] = worker.busy_s - busy0
                last_ms = bus.last_added_ms(GENERATED)
                if last_ms is None:
                    raise RuntimeError("the rollout worker added no group to the bus")
                timed["t1"] = last_ms / 1000
                # after the window: its last acknowledgements
                _wait_units_done(bus, warm + n_units, failed)
                timed["writes"] = [
                    now - then for now, then in zip(worker.settled_bus_writes(), writes0)
                ]
            except BaseException as err:  # noqa: BLE001 - reported by the arm
                failed.append(err)
            finally:
                stop.set()
                bus.set_done()

        feeder = threading.Thread(target=feed, name="bench-feed", daemon=True)
        feeder.start()
        try:
            code = worker.run()
        finally:
            load_s = worker.engine.load_s if worker.engine is not None else None
            worker.close()
        feeder.join(timeout=30)
        if failed:
            raise failed[0]
        if code != 0 or "t1" not in timed:
            raise RuntimeError(
                f"the rollout worker ended with {code} before every group was generated"
            )
        c = bus.counters()
        wall = timed["t1"] - timed["t0"]
        start = timed["start"]
        return {
            "tokens": c["tokens_generated"] - start["tokens_generated"],
            "groups": c["groups_generated"] - warm_groups,
            "wall_s": wall,
            "load_s": load_s,
            "warmup_units": warm,
            "busy_fraction": timed["busy"] / wall,
            "units_overlapped": c["units_overlapped"] - start["units_overlapped"],
            "units_in_flight": cfg.rollout.units_in_flight,
            "weight_update": cfg.rollout.weight_update,
            "swaps": c.get("swaps", 0),
            "swaps_in_flight": c.get("swaps_in_flight", 0),
            "samples_mixed_version": c.get("samples_mixed_version", 0),
            # the outbox's batching: publications and acknowledgements per Valkey round trip
            "bus_writes": timed["writes"][0],
            "bus_round_trips": timed["writes"][1],
            **_drain_stats(bus.stats().get("rollout-0", {}), cfg.rollout.max_num_seqs),
        }
    finally:
        if server is not None:
            server.stop()


def _drain_stats(st: dict[str, float], max_num_seqs: int) -> dict[str, Any]:
    """The worker's between-units drains: seconds, engine steps, their mean batch, and the share of
    those steps' batch slots left empty (on a GPU, where a decode step costs about the same at
    any batch up to max_num_seqs, the share of the drain's engine time that was wasted)."""
    steps = st.get("version_drain_steps", 0.0)
    mean = st.get("version_drain_seqs", 0.0) / steps if steps else None
    return {
        "last_swap_s": st.get("last_swap_s"),
        "drain_s": st.get("version_drain_s", 0.0),
        "drain_steps": int(steps),
        "drain_mean_batch": mean,
        "drain_empty_slots": None if mean is None else 1 - min(mean / max_num_seqs, 1.0),
    }


def _distinct_ints(text: str, flag: str, what: str, hi: int) -> tuple[int, ...]:
    """A comma-separated list of distinct integers in 1..hi, or ConfigError naming the flag."""
    try:
        xs = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        xs = ()
    if not xs or any(k < 1 or k > hi for k in xs) or len(set(xs)) != len(xs):
        raise ConfigError(
            f"bench rollout: {flag} must list distinct {what} in 1..{hi}, comma-separated; got {text!r}"
        )
    return xs


def parse_in_flight(text: str) -> tuple[int, ...]:
    return _distinct_ints(text, "--in-flight", "unit counts", 64)


def _with(cfg: RunConfig, **rollout: Any) -> RunConfig:
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update=rollout)})


def parse_seqs(text: str) -> tuple[int, ...]:
    return _distinct_ints(text, "--max-num-seqs", "sequence counts", 65536)


def parse_updates(text: str) -> tuple[str, ...]:
    ups = tuple(x.strip() for x in text.split(",") if x.strip())
    if not ups or set(ups) - set(UPDATES) or len(set(ups)) != len(ups):
        raise ConfigError(
            f"bench rollout: --updates must list distinct rollout.weight_update values of "
            f"{', '.join(UPDATES)}, comma-separated; got {text!r}"
        )
    return ups


def run_bench_rollout(
    config: str | Path,
    overrides: Sequence[str] = (),
    units: int = 4,
    in_flight: str = "1,2",
    out: str | Path = "bench/rollout.json",
    echo=print,
    workload: str = "digits",
    updates: str = "between_units",
    swap_every: float = 0.0,
    max_num_seqs: str | None = None,
    warmup_units: int = WARMUP_UNITS,
    repeats: int = 1,
    breakdown: bool = False,
    all2all: str | None = None,
    tensor_parallel: str | None = None,
    data_parallel: str | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """`all2all` / `tensor_parallel` / `data_parallel` (comma-separated lists): compare engine
    layouts instead of the worker arms (benchmarks/layouts.py; `timeout_s` bounds each
    variant's round there).
    `max_num_seqs`: a comma-separated sweep of rollout.max_num_seqs (every arm at each, arms
    named `<arm>@<K>`, each worker compared with the bare engine at its K); None: the config's.
    `warmup_units`: units every arm generates before its window (0: time cold engines).
    `repeats`: rounds of every arm, interleaved; an arm reports its median round (`_combine`).
    `breakdown`: also the `_breakdown` child (where the worker's time goes, one engine, windows
    of `units` units), reported under `breakdown`.

    Args:
        config: the workload's run config (YAML)
        overrides: config overrides KEY=VALUE (repeatable)
        units: units of units.max_prompts prompts (async settings)
        in_flight: the worker arms' rollout.units_in_flight, comma-separated
        out: the report (JSON)
        workload: digits (the config's task) or long-tail (responses of widely varying length,
            up to 384 tokens)
        updates: the worker arms' rollout.weight_update values, comma-separated:
            between_units, in_flight
        swap_every: publish a new version every this many seconds while a worker arm runs (0:
            one version)
        max_num_seqs: a sweep of rollout.max_num_seqs, comma-separated: every arm at each value
            (default: the config's)
        warmup_units: units every arm generates before its timed window, other prompts than the
            timed ones (0: time cold engines)
        repeats: rounds of every arm, interleaved (bare, workers, bare, ...); each worker's
            ratio is the median of its rounds' ratios to the same round's bare engine
        breakdown: also where the worker's time goes: one engine driven by generate, the
            worker's submit/step loop, with seeds, with samples, with the bus, interleaved
            (windows of --units units)
        all2all: compare engine layouts instead of the worker arms: rollout.all2all_backend
            values (expert parallelism on; `none`: off), comma-separated, e.g.
            allgather_reducescatter,deepep_v2 (cuda, tensor x data parallel > 1). The variants
            are the product of --all2all, --tensor-parallel and --data-parallel, each one engine
            in its own process, rounds interleaved; tokens/s and per-token latency, ratios to
            the first
        tensor_parallel: layout variants: rollout.tensor_parallel_size values, comma-separated
            (see --all2all)
        data_parallel: layout variants: rollout.data_parallel_size values, comma-separated (see
            --all2all)
        timeout_s: a layout variant's round may take this many seconds (its engine's load,
            warm-up and window; default 1800)
    """
    if not 1 <= units <= 1024:
        raise ConfigError(f"bench rollout: --units must be in 1..1024, got {units}")
    if not 1 <= repeats <= 20:
        raise ConfigError(f"bench rollout: --repeats must be in 1..20, got {repeats}")
    if not 0 <= warmup_units <= 64:
        raise ConfigError(f"bench rollout: --warmup-units must be in 0..64, got {warmup_units}")
    if workload not in WORKLOADS:
        raise ConfigError(
            f"bench rollout: --workload must be one of {', '.join(WORKLOADS)}, got {workload!r}"
        )
    if not 0 <= swap_every <= 3600:
        raise ConfigError(
            f"bench rollout: --swap-every must be 0 (no swaps) or seconds up to 3600, got {swap_every}"
        )
    if all2all or tensor_parallel or data_parallel:
        from benchmarks.layouts import TIMEOUT_S, run_bench_layouts

        extra = [
            flag
            for flag, used in (
                ("--updates", updates != "between_units"),
                ("--swap-every", swap_every > 0),
                ("--max-num-seqs", max_num_seqs is not None),
                ("--breakdown", breakdown),
            )
            if used
        ]
        if extra:
            raise ConfigError(
                f"bench rollout: {', '.join(extra)} belong to the worker arms, not to a layout "
                "comparison (--all2all / --tensor-parallel / --data-parallel); run them apart"
            )
        return run_bench_layouts(
            config,
            (list(LONG_TAIL) if workload == "long-tail" else []) + list(overrides),
            all2all=all2all,
            tensor_parallel=tensor_parallel,
            data_parallel=data_parallel,
            units=units,
            warmup_units=warmup_units,
            repeats=repeats,
            out=out,
            echo=echo,
            timeout_s=TIMEOUT_S if timeout_s is None else timeout_s,
        )
    elif timeout_s is not None:
        raise ConfigError(
            "bench rollout: --timeout bounds a layout comparison's variants; it needs --all2all, "
            "--tensor-parallel or --data-parallel"
        )
    ks, ups = parse_in_flight(in_flight), parse_updates(updates)
    sweep = parse_seqs(max_num_seqs) if max_num_seqs else ()
    base = list(LONG_TAIL) if workload == "long-tail" else []
    cfg = load_config(config, base + list(overrides), mode="async")
    sweep = sweep or (cfg.rollout.max_num_seqs,)
    rounds: dict[str, list[dict[str, Any]]] = {}  # each arm's result in every round
    with tempfile.TemporaryDirectory(prefix="moerl-bench-rollout-") as tmp:
        plan: list[tuple[str, str, RunConfig]] = []
        bare_of: dict[str, str] = {}  # bare_of: each arm's bare engine (the same max_num_seqs)
        for seqs in sweep:
            at = f"@{seqs}" if len(sweep) > 1 else ""
            plan += [(f"bare{at}", "bare", _with(cfg, max_num_seqs=seqs))] + [
                (
                    f"worker-{k}" + ("-inflight" if u == "in_flight" else "") + at,
                    "worker",
                    _with(cfg, max_num_seqs=seqs, units_in_flight=k, weight_update=u),
                )
                for k in ks
                for u in ups
            ]
            bare_of.update((name, f"bare{at}") for name, _, _ in plan[-1 - len(ks) * len(ups) :])
        # interleaved: a slow stretch of the machine hits every arm of a round
        for rnd in range(repeats):
            for name, command, arm_cfg in plan:
                work = Path(tmp) / f"{name}.{rnd}"
                work.mkdir()
                echo(
                    f"[bench rollout] {name}"
                    + (f" (round {rnd + 1} of {repeats})" if repeats > 1 else "")
                    + " ..."
                )
                code, result, log = run_child(
                    "benchmarks.rollout",
                    command,
                    arm_cfg,
                    units,
                    work,
                    name,
                    env_extra={SWAP_ENV: repr(float(swap_every)), WARMUP_ENV: str(warmup_units)},
                )
                if code != 0 or not result.exists():
                    rounds.setdefault(name, []).append({"ok": False, "error": log_tail(log)})
                    continue
                r = json.loads(result.read_text())
                r["tokens_per_s"] = r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else None
                rounds.setdefault(name, []).append({"ok": True, **r})
        split: dict[str, Any] | None = None
        if breakdown:
            work = Path(tmp) / "breakdown"
            work.mkdir()
            echo("[bench rollout] breakdown (one engine, every way in turn) ...")
            code, result, log = run_child(
                "benchmarks.rollout",
                "breakdown",
                cfg,
                units,
                work,
                "breakdown",
                env_extra={WARMUP_ENV: str(warmup_units)},
            )
            split = (
                {"ok": True, **json.loads(result.read_text())}
                if code == 0 and result.exists()
                else {"ok": False, "error": log_tail(log)}
            )
    arms = {
        name: _combine(
            rounds[name],
            [rounds[bare_of[name]][i].get("tokens_per_s") for i in range(repeats)]
            if command == "worker"
            else None,
        )
        for name, command, _ in plan
    }
    for name, _, arm_cfg in plan:
        arms[name]["max_num_seqs"] = arm_cfg.rollout.max_num_seqs
    shape = {
        "workload": workload,
        "units": units,
        "prompts_per_unit": cfg.units.max_prompts,
        "samples_per_prompt": cfg.rollout.samples_per_prompt,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "max_num_seqs": list(sweep) if len(sweep) > 1 else cfg.rollout.max_num_seqs,
        "dataset": cfg.task.dataset,
        "swap_every_s": swap_every,
        "inflight_kv": cfg.rollout.inflight_kv,
        "warmup_units": warmup_units,
        "repeats": repeats,
        **{
            k: arms.get("bare" + (f"@{sweep[0]}" if len(sweep) > 1 else ""), {}).get(k)
            for k in ("length_p50", "length_p90", "length_p99", "length_max")
        },
    }
    ok = all(r.get("ok") for r in arms.values()) and (split is None or split["ok"])
    report = envelope(
        "rollout", ok, workload=shape, arms=arms, **({"breakdown": split} if split else {})
    )
    write_report(Path(out), report)
    echo(format_report(report))
    return report


def _combine(results: list[dict[str, Any]], bare_tps: list[float | None] | None) -> dict[str, Any]:
    """One arm's rounds as one result: the round of median tokens/s, with every round's tokens/s;
    a worker arm (`bare_tps`: the same rounds' bare engine) also gets each round's ratio to bare
    and `ratio_to_bare`, their median (what one noisy round cannot say: the spread is there)."""
    if not all(r.get("ok") for r in results):
        bad = next(r for r in results if not r.get("ok"))
        return {**bad, "rounds": len(results)}
    tps = [r["tokens_per_s"] for r in results]
    mid = results[sorted(range(len(tps)), key=lambda i: tps[i])[(len(tps) - 1) // 2]]
    out = {**mid, "rounds": len(results), "tokens_per_s_rounds": tps}
    if bare_tps is not None and all(bare_tps):
        ratios = [t / b for t, b in zip(tps, bare_tps)]
        out["ratio_rounds"] = ratios
        out["ratio_to_bare"] = statistics.median(ratios)
    return out


def format_report(report: dict[str, Any]) -> str:
    spread = lambda xs: f"{min(xs):.2f}-{max(xs):.2f}" if xs and len(xs) > 1 else None  # noqa: E731
    rows = [
        (
            name,
            r.get("ok"),
            r.get("tokens"),
            r.get("wall_s"),
            r.get("tokens_per_s"),
            r.get("ratio_to_bare"),
            spread(r.get("ratio_rounds")),
            r.get("busy_fraction"),
            r.get("units_overlapped"),
            r.get("swaps"),
            r.get("swaps_in_flight"),
            r.get("drain_s"),
            r.get("drain_steps"),
            r.get("drain_mean_batch"),
            r.get("load_s"),
        )
        for name, r in report["arms"].items()
    ]
    w = report["workload"]
    head = (
        f"rollout ({w.get('workload', 'digits')}): {w['units']} units x {w['prompts_per_unit']} prompts x "
        f"G={w['samples_per_prompt']}, max_new_tokens {w['max_new_tokens']}, max_num_seqs {w['max_num_seqs']}, "
        f"response length p50/p90/max {w.get('length_p50')}/{w.get('length_p90')}/{w.get('length_max')}"
        + (
            f", a version every {w['swap_every_s']:g} s (in-flight KV {w.get('inflight_kv')})"
            if w.get("swap_every_s")
            else ""
        )
        + (
            f"; {w['repeats']} interleaved rounds: each arm's median round, x bare the median of the rounds' "
            "ratios"
            if w.get("repeats", 1) > 1
            else ""
        )
    )
    text = (
        head
        + "\n"
        + format_table(
            [
                "arm",
                "ok",
                "tokens",
                "wall s",
                "tokens/s",
                "x bare",
                "rounds",
                "busy",
                "overlapped",
                "swaps",
                "in flight",
                "drain s",
                "drain steps",
                "drain batch",
                "load s",
            ],
            rows,
        )
    )
    b = report.get("breakdown")
    if b and b.get("ok"):
        text += (
            f"\nbreakdown: one engine, windows of {b['units_per_window']} units, {b['rounds']} interleaved rounds; "
            "each way adds to the loop above it (loop+seeds only adds seeds)\n"
            + format_table(
                ["way", "tokens/s", "x generate", "rounds"],
                [
                    (k, way["tokens_per_s"], way["ratio_to_generate"], spread(way["ratio_rounds"]))
                    for k, way in b["ways"].items()
                ],
            )
        )
    elif b:
        text += f"\nbreakdown failed: {b.get('error')}"
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    swap_every = float(os.environ.get(SWAP_ENV, "0"))
    fn = {"bare": _bare, "breakdown": _breakdown}.get(
        argv[0] if argv else "", lambda cfg, n, work: _worker(cfg, n, work, swap_every)
    )
    return child_main(
        argv, "benchmarks.rollout", argv[0] if argv else "worker", "bench rollout arm", fn
    )


if __name__ == "__main__":
    sys.exit(main())
