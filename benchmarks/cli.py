"""Every `moerl bench` command, and `moerl compare`, in one place (docs/benchmarks.md).

Design, details and limitations: docs/benchmarks.md#moerlbenchclipy.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def _suite(a: argparse.Namespace) -> int:
    from moerl.bench.suite import run_suite

    rep = run_suite(
        a.config,
        a.set,
        repeats=a.repeats,
        iterations=a.iterations,
        out_dir=a.out_dir,
        store=a.store,
        dispatch=not a.no_dispatch,
        mlflow=not a.no_mlflow,
        work_dir=a.work_dir,
    )
    return 0 if rep["ok"] else 1


def _scaling(a: argparse.Namespace) -> int:
    from moerl.bench.scaling import parse_sizes, run_bench_scaling

    rep = run_bench_scaling(
        a.config,
        a.set,
        workers=parse_sizes(a.workers, "workers"),
        scorers=parse_sizes(a.scorers, "scorers"),
        versions=a.versions,
        out_dir=a.out_dir,
        work_dir=a.work_dir,
    )
    return 0 if rep["ok"] else 1


def _failures(a: argparse.Namespace) -> int:
    from moerl.bench.failures import parse_kinds, run_bench_failures

    rep = run_bench_failures(
        a.config,
        a.set,
        versions=a.versions,
        kinds=parse_kinds(a.kinds),
        faults_per_minute=a.faults_per_minute,
        max_faults=a.max_faults,
        out_dir=a.out_dir,
        work_dir=a.work_dir,
    )
    return 0 if rep["ok"] else 1


def _modes(a: argparse.Namespace) -> int:
    from moerl.bench.modes import parse_arms, run_bench_modes

    rep = run_bench_modes(
        a.config,
        a.set,
        iterations=a.iterations,
        out=a.out,
        arms=parse_arms(a.arms),
        work_dir=a.work_dir,
        reward_target=a.reward_target,
        floor_settings=a.floor_settings,
    )
    return 0 if rep["ok"] else 1


def _peer(a: argparse.Namespace) -> int:
    from moerl.bench.peer import parse_targets, run_bench_peer

    rep = run_bench_peer(
        a.config,
        a.set,
        rounds=a.rounds,
        versions=a.versions,
        targets=parse_targets(a.targets),
        out_dir=a.out_dir,
    )
    return 0 if rep["ok"] else 1


def _fleet(a: argparse.Namespace) -> int:
    from moerl.bench.fleet import run_bench_fleet

    rep = run_bench_fleet(
        a.config,
        a.set,
        versions=a.versions,
        repeats=a.repeats,
        out_dir=a.out_dir,
        timeout_s=a.timeout_s,
    )
    return 0 if rep["ok"] else 1


def _rollout(a: argparse.Namespace) -> int:
    from moerl.bench.rollout import run_bench_rollout

    rep = run_bench_rollout(
        a.config,
        a.set,
        units=a.units,
        in_flight=a.in_flight,
        out=a.out,
        workload=a.workload,
        updates=a.updates,
        swap_every=a.swap_every,
        max_num_seqs=a.max_num_seqs,
        warmup_units=a.warmup_units,
        repeats=a.repeats,
        breakdown=a.breakdown,
        all2all=a.all2all,
        tensor_parallel=a.tensor_parallel,
        data_parallel=a.data_parallel,
        timeout_s=a.timeout,
    )
    return 0 if rep["ok"] else 1


def _mismatch(a: argparse.Namespace) -> int:
    from moerl.bench.mismatch import run_bench_mismatch

    rep = run_bench_mismatch(
        a.config,
        a.set,
        versions=a.versions,
        router_noise=a.router_noise,
        arms=[x.strip() for x in a.arms.split(",") if x.strip()],
        dynamic=not a.no_dynamic,
        min_signal_groups=a.min_signal_groups,
        out=a.out,
        work_dir=a.work_dir,
    )
    return 0 if rep["ok"] else 1


def _project(a: argparse.Namespace) -> int:
    from moerl.bench.project import run_project

    rep = run_project(a, Path(a.out_dir))
    return 0 if rep["ok"] else 1


def _weights(a: argparse.Namespace) -> int:
    from moerl.bench.weights import run_bench

    rows = run_bench(
        [s for s in a.sizes.split(",") if s],
        Path(a.out),
        repeats=a.repeats,
        endpoint_url=a.endpoint_url,
        bucket=a.bucket,
        tiers=not a.no_tiers,
    )
    return 0 if all(r.parity_ok for r in rows) else 1


def _dispatch(a: argparse.Namespace) -> int:
    from moerl.bench.dispatch import run_bench_dispatch

    run_bench_dispatch(
        tokens=a.tokens,
        hidden=a.hidden,
        topk=a.topk,
        experts=a.experts,
        skew=a.skew,
        world_sizes=tuple(int(w) for w in a.world_sizes.split(",")),
        ranks_per_node=a.ranks_per_node,
        warmup=a.warmup,
        repeats=a.repeats,
        out=Path(a.out),
    )
    return 0


def _ep_memory(a: argparse.Namespace) -> int:
    from moerl.bench.ep_memory import parse_meshes, parse_world_sizes, run_bench_ep_memory

    run_bench_ep_memory(
        parse_world_sizes(a.world_sizes),
        Path(a.out),
        meshes=parse_meshes(a.meshes) if a.meshes else None,
        num_layers=a.layers,
        num_experts=a.experts,
        hidden_size=a.hidden,
        moe_intermediate_size=a.moe_intermediate_size,
    )
    return 0


def _tasks(a: argparse.Namespace) -> int:
    from moerl.bench.tasks import run_bench_tasks

    rep = run_bench_tasks(a.calls, a.engine, a.prompts, Path(a.out))
    return 0 if rep["ok"] else 1


def _lease(a: argparse.Namespace) -> int:
    from moerl.bench.lease import run_bench_lease
    from moerl.errors import ConfigError

    try:
        pending = [int(x) for x in a.pending.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(
            f"--pending must be comma-separated integers, got {a.pending!r}"
        ) from None
    rep = run_bench_lease(pending, a.leases, Path(a.out))
    return 0 if rep["ok"] else 1


def _fanout(a: argparse.Namespace) -> int:
    from moerl.bench.fanout import run_bench_fanout

    rep = run_bench_fanout(
        Path(a.out),
        peers=a.peers,
        chunks=a.chunks,
        version_s=a.version_s,
        windows=a.windows,
        window_s=a.window_s,
        seed=a.seed,
    )
    return 0 if rep["ok"] else 1


def _state(a: argparse.Namespace) -> int:
    from moerl.bench.state import run_bench_state

    rep = run_bench_state(a.versions, Path(a.out), tuple(a.set or ()))
    return 0 if rep["ok"] else 1


def _trainer_versions(a: argparse.Namespace) -> int:
    from moerl.bench.trainer_versions import parse_mesh, run_bench_trainer_versions

    model = {
        k: v
        for k, v in (
            ("hidden_size", a.hidden),
            ("num_layers", a.layers),
            ("num_experts", a.experts),
            ("moe_intermediate_size", a.moe_intermediate_size),
        )
        if v is not None
    }
    rep = run_bench_trainer_versions(
        Path(a.out),
        versions=a.versions,
        repeats=a.repeats,
        mesh=parse_mesh(a.mesh),
        steps=a.steps,
        samples=a.samples,
        model=model,
        work_dir=Path(a.work_dir) if a.work_dir else None,
    )
    return 0 if rep["ok"] else 1


def _compare(a: argparse.Namespace) -> int:
    from moerl.bench.compare import run_compare

    run_compare(a.run_ids, tracking_uri=a.tracking_uri, out_dir=a.out_dir, log_run=not a.no_mlflow)
    return 0


def _workload_args(p: argparse.ArgumentParser, out_dir: str) -> None:
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out-dir", default=out_dir)
    p.add_argument(
        "--work-dir",
        default=None,
        help="keep every run's files here (default: a temp dir, deleted)",
    )


def add_bench_parsers(sub) -> None:
    """`moerl bench ...` and `moerl compare` on the top-level subparsers `sub`."""
    bench = sub.add_parser("bench", help="benchmarks (side by side, ratios, docs/benchmarks.md)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    su = bsub.add_parser(
        "suite",
        help="the workload, every stage measured, repeated (report, summary, plots, MLflow)",
    )
    _workload_args(su, "bench/suite")
    su.add_argument(
        "--repeats", type=int, default=3, help="independent repeats (>= 3 for a useful interval)"
    )
    su.add_argument("--iterations", type=int, default=3, help="policy versions per repeat")
    su.add_argument(
        "--store",
        choices=("s3", "local", "config"),
        default="s3",
        help="s3: weed mini on 127.0.0.1, started and stopped here (default); local: a directory; "
        "config: the config's checkpoint store (the run bucket on EKS)",
    )
    su.add_argument(
        "--no-dispatch",
        action="store_true",
        help="skip the dispatcher comparison at the model's shape",
    )
    su.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    su.set_defaults(func=_suite)

    sc = bsub.add_parser(
        "scaling", help="the same workload at several rollout-worker / scorer counts (async)"
    )
    _workload_args(sc, "bench/scaling")
    sc.add_argument("--workers", default="1,2,4")
    sc.add_argument("--scorers", default="1")
    sc.add_argument("--versions", type=int, default=4)
    sc.set_defaults(func=_scaling)

    fa = bsub.add_parser(
        "failures", help="policy-iteration time under injected SIGTERM / SIGKILL (async)"
    )
    _workload_args(fa, "bench/failures")
    fa.add_argument("--versions", type=int, default=6)
    fa.add_argument("--kinds", default="sigterm,sigkill")
    fa.add_argument("--faults-per-minute", type=float, default=2.0)
    fa.add_argument("--max-faults", type=int, default=2)
    fa.set_defaults(func=_failures)

    mo = bsub.add_parser(
        "modes", help="the same workload in sync, async and the one-process floor, side by side"
    )
    mo.add_argument("config")
    mo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    mo.add_argument(
        "--iterations",
        type=int,
        default=10,
        help="versions per arm (sync iterations = async versions)",
    )
    mo.add_argument("--arms", default="floor,sync,async")
    mo.add_argument("--out", default="bench/modes.json")
    mo.add_argument(
        "--work-dir", default=None, help="keep each arm's files here (default: a temp dir, deleted)"
    )
    mo.add_argument(
        "--reward-target",
        type=float,
        default=0.8,
        help="report each arm's seconds to the first version whose reward/mean reaches this",
    )
    mo.add_argument(
        "--floor-settings",
        default="sync",
        choices=("sync", "async"),
        help="whose modes: settings the "
        "floor trains with (async: the same as the async arm's, a like-for-like time to the target)",
    )
    mo.set_defaults(func=_modes)

    pe = bsub.add_parser(
        "peer",
        help="moerl's async run against TRL's GRPOTrainer on the same version 0, prompts, "
        "verifier and settings: time to each reward level, per version (the moerl[peer] extra)",
    )
    pe.add_argument("config", nargs="?", default="configs/tiny-moe-grpo.yaml")
    pe.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    pe.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of both arms, interleaved (the first arm alternates); ratios are medians",
    )
    pe.add_argument(
        "--versions",
        type=int,
        default=None,
        help="versions per arm (default: the config's async pipeline.versions)",
    )
    pe.add_argument(
        "--targets",
        default="0.5,0.9,0.99",
        help="reward levels: each arm's seconds to the first version whose batch reached each",
    )
    pe.add_argument(
        "--out-dir",
        default="bench/peer",
        help="report.json, summary.md, v0/ and round<i>/<arm>/ (replaced by each run)",
    )
    pe.set_defaults(func=_peer)

    fl = bsub.add_parser(
        "fleet",
        help="an elastic rollout fleet (min..max workers) against a fixed one (min), on a workload "
        "whose response length changes mid-run: time, worker-seconds, idle, starvation",
    )
    fl.add_argument("config")
    fl.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    fl.add_argument(
        "--versions",
        type=int,
        default=None,
        help="versions per arm (default: the config's async pipeline.versions)",
    )
    fl.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of both arms, interleaved (the first arm alternates); the table shows medians",
    )
    fl.add_argument(
        "--out-dir",
        default="bench/fleet",
        help="report.json, summary.md and round<i>/<arm>/ (replaced by each run)",
    )
    fl.add_argument(
        "--timeout-s",
        type=float,
        default=1800.0,
        help="each arm's run is killed after this long, and the bench fails (default 1800)",
    )
    fl.set_defaults(func=_fleet)

    ro = bsub.add_parser(
        "rollout",
        help="the async rollout worker's output tokens/s against a bare vLLM engine on "
        "the same prompts, side by side",
    )
    ro.add_argument("config")
    ro.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ro.add_argument(
        "--units", type=int, default=4, help="units of units.max_prompts prompts (async settings)"
    )
    ro.add_argument(
        "--in-flight",
        default="1,2",
        help="the worker arms' rollout.units_in_flight, comma-separated",
    )
    ro.add_argument(
        "--workload",
        default="digits",
        help="digits (the config's task) or long-tail (responses of "
        "widely varying length, up to 384 tokens)",
    )
    ro.add_argument(
        "--updates",
        default="between_units",
        help="the worker arms' rollout.weight_update values, "
        "comma-separated: between_units, in_flight",
    )
    ro.add_argument(
        "--max-num-seqs",
        default=None,
        help="a sweep of rollout.max_num_seqs, comma-separated: every "
        "arm at each value (default: the config's)",
    )
    ro.add_argument(
        "--swap-every",
        type=float,
        default=0.0,
        help="publish a new version every this many seconds "
        "while a worker arm runs (0: one version)",
    )
    ro.add_argument(
        "--warmup-units",
        type=int,
        default=2,
        help="units every arm generates before its timed "
        "window, other prompts than the timed ones (0: time cold engines)",
    )
    ro.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every arm, interleaved (bare, workers, bare, "
        "...); each worker's ratio is the median of its rounds' ratios to the same round's bare engine",
    )
    ro.add_argument(
        "--breakdown",
        action="store_true",
        help="also where the worker's time goes: one engine "
        "driven by generate, the worker's submit/step loop, with seeds, with samples, with the bus, "
        "interleaved (windows of --units units)",
    )
    ro.add_argument(
        "--all2all",
        default=None,
        help="compare engine layouts instead of the worker arms: "
        "rollout.all2all_backend values (expert parallelism on; `none`: off), comma-separated, "
        "e.g. allgather_reducescatter,deepep_v2 (cuda, tensor x data parallel > 1). The variants "
        "are the product of --all2all, --tensor-parallel and --data-parallel, each one engine in "
        "its own process, rounds interleaved; tokens/s and per-token latency, ratios to the first",
    )
    ro.add_argument(
        "--tensor-parallel",
        default=None,
        help="layout variants: rollout.tensor_parallel_size values, comma-separated (see --all2all)",
    )
    ro.add_argument(
        "--data-parallel",
        default=None,
        help="layout variants: rollout.data_parallel_size values, comma-separated (see --all2all)",
    )
    ro.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="a layout variant's round may take this many seconds (its engine's load, warm-up "
        "and window; default 1800)",
    )
    ro.add_argument("--out", default="bench/rollout.json")
    ro.set_defaults(func=_rollout)

    mm = bsub.add_parser(
        "mismatch",
        help="MoE training-inference mismatch: routing replay under an induced router "
        "mismatch, and dynamic sampling, side by side",
    )
    mm.add_argument("config")
    mm.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    mm.add_argument("--versions", type=int, default=24, help="versions per arm")
    mm.add_argument(
        "--router-noise",
        type=float,
        default=0.1,
        help="the engine's routers are perturbed by this x each router weight's std (0 = none)",
    )
    mm.add_argument("--arms", default="disabled,R3", help="replay arms: disabled, R3, R2, gspo")
    mm.add_argument(
        "--no-dynamic", action="store_true", help="skip the dynamic-sampling arms (two async runs)"
    )
    mm.add_argument(
        "--min-signal-groups",
        type=int,
        default=None,
        help="the dynamic arm's buffer.min_signal_groups (default: task.prompts_per_iteration)",
    )
    mm.add_argument("--out", default="bench/mismatch.json")
    mm.add_argument(
        "--work-dir", default=None, help="keep each arm's files here (default: a temp dir, deleted)"
    )
    mm.set_defaults(func=_mismatch)

    from moerl.bench.project import add_project_args

    pr = bsub.add_parser(
        "project",
        help="the seed's scale on paper: dispatch share, rollout gain of a faster dispatcher",
    )
    add_project_args(pr)
    pr.set_defaults(func=_project)

    bw = bsub.add_parser(
        "weights", help="publish / fetch / hot-swap / redistribution of a policy version"
    )
    bw.add_argument("--sizes", default="tiny,0.5b", help="comma-separated: tiny, 0.5b")
    bw.add_argument("--repeats", type=int, default=3)
    bw.add_argument("--out", default="bench/weights.json")
    bw.add_argument(
        "--endpoint-url",
        default=None,
        help="an S3 endpoint (default: start weed mini on 127.0.0.1)",
    )
    bw.add_argument("--bucket", default="moerl-bench")
    bw.add_argument(
        "--no-tiers",
        action="store_true",
        help="skip the publisher / cache tier / fan-out part (a second weed mini, a Valkey, reader processes)",
    )
    bw.set_defaults(func=_weights)

    bd = bsub.add_parser(
        "dispatch", help="expert-parallel dispatch/combine backends side by side (gloo here)"
    )
    bd.add_argument("--tokens", type=int, default=4096)
    bd.add_argument("--hidden", type=int, default=1024)
    bd.add_argument("--topk", type=int, default=8)
    bd.add_argument("--experts", type=int, default=64)
    bd.add_argument("--skew", choices=["uniform", "zipf"], default="uniform")
    bd.add_argument("--world-sizes", default="2,4")
    bd.add_argument("--ranks-per-node", type=int, default=2)
    bd.add_argument("--warmup", type=int, default=5)
    bd.add_argument("--repeats", type=int, default=20)
    bd.add_argument("--out", default="bench/dispatch.json")
    bd.set_defaults(func=_dispatch)

    bm = bsub.add_parser(
        "ep-memory", help="per-rank state bytes (vs 1/world) and peak RSS at several trainer meshes"
    )
    bm.add_argument("--world-sizes", default="1,2,4", help="meshes 1xW (expert parallel only)")
    bm.add_argument(
        "--meshes", default=None, help="DPxEP meshes, e.g. 1x4,2x2,4x1 (overrides --world-sizes)"
    )
    bm.add_argument("--layers", type=int, default=None, help="default 4")
    bm.add_argument("--experts", type=int, default=None, help="default 64")
    bm.add_argument("--hidden", type=int, default=None, help="default 512")
    bm.add_argument("--moe-intermediate-size", type=int, default=None, help="default 256")
    bm.add_argument("--out", default="bench/ep_memory.json")
    bm.set_defaults(func=_ep_memory)

    bt = bsub.add_parser(
        "tasks",
        help="verifier / environment calls in-process vs the sandboxed pool vs Valkey, "
        "and the environments' share of a multi-turn rollout",
    )
    bt.add_argument("--calls", type=int, default=300, help="calls per latency row")
    bt.add_argument(
        "--engine", action="store_true", help="also the lookup task's episodes on the tiny engine"
    )
    bt.add_argument(
        "--prompts", type=int, default=64, help="prompts of the multi-turn rollout (x G episodes)"
    )
    bt.add_argument("--out", default="bench/tasks.json")
    bt.set_defaults(func=_tasks)

    le = bsub.add_parser(
        "lease",
        help="a rollout worker's lease as the pending list grows: the bus's way against "
        "XAUTOCLAIM paging (Valkey commands and wall time per lease)",
    )
    le.add_argument(
        "--pending",
        default="0,256,1024,4096",
        help="pending-list lengths (units other workers hold)",
    )
    le.add_argument("--leases", type=int, default=50, help="leases timed at each length, each way")
    le.add_argument("--out", default="bench/lease.json")
    le.set_defaults(func=_lease)

    fo = bsub.add_parser(
        "fanout",
        help="the fan-out's bookkeeping for one version (simulated peers, a real Valkey): "
        "Valkey commands and CPU, now against the per-chunk sets it replaced",
    )
    fo.add_argument("--peers", type=int, default=32, help="rollout workers fetching the version")
    fo.add_argument(
        "--chunks", type=int, default=7000, help="chunks per version (Qwen3-235B at 64 MiB: ~7,000)"
    )
    fo.add_argument(
        "--version-s", type=float, default=75.0, help="virtual seconds one version's fetch takes"
    )
    fo.add_argument(
        "--windows",
        type=int,
        default=4,
        help="measured windows spread over the version (0: all of it)",
    )
    fo.add_argument(
        "--window-s", type=float, default=1.0, help="virtual seconds per measured window"
    )
    fo.add_argument("--seed", type=int, default=0)
    fo.add_argument("--out", default="bench/fanout.json")
    fo.set_defaults(func=_fanout)

    from moerl.bench.wide_ep import add_parser as add_wide_ep

    add_wide_ep(bsub)

    st = bsub.add_parser(
        "state", help="Valkey's and each stage's memory over a long async run (bounded state)"
    )
    st.add_argument("--versions", type=int, default=200, help="versions of the tiny model to run")
    st.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="a config override (repeatable)"
    )
    st.add_argument("--out", default="bench/state.json")
    st.set_defaults(func=_state)

    tv = bsub.add_parser(
        "trainer-versions",
        help="the async trainer's overhead per version on a gloo mesh: restarting the ranks "
        "every version against ranks spawned once, interleaved, side by side",
    )
    tv.add_argument("--versions", type=int, default=4, help="versions per arm and repeat")
    tv.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of both arms (a new persistent mesh each); which arm runs a version first "
        "alternates by version and by round",
    )
    tv.add_argument("--mesh", default="2x2", help="DPxEP (gloo ranks on this machine)")
    tv.add_argument("--steps", type=int, default=2, help="optimizer steps per version")
    tv.add_argument("--samples", type=int, default=16, help="samples per version's batch")
    tv.add_argument("--hidden", type=int, default=None, help="tiny MoE hidden size (default 128)")
    tv.add_argument("--layers", type=int, default=None, help="tiny MoE layers (default 2)")
    tv.add_argument("--experts", type=int, default=None, help="routed experts (default 8)")
    tv.add_argument("--moe-intermediate-size", type=int, default=None, help="default 64")
    tv.add_argument("--out", default="bench/trainer-versions", help="report.json, summary.md")
    tv.add_argument(
        "--work-dir", default=None, help="keep every version's files here (default: a temp dir)"
    )
    tv.set_defaults(func=_trainer_versions)
    co = sub.add_parser(
        "compare", help="MLflow runs side by side: differing params, metric deltas vs noise, plots"
    )
    co.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    co.add_argument(
        "--tracking-uri",
        default=None,
        help="default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db",
    )
    co.add_argument("--out-dir", default="bench/compare")
    co.add_argument(
        "--no-mlflow", action="store_true", help="do not log the comparison as an MLflow run"
    )
    co.set_defaults(func=_compare)
