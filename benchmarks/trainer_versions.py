"""`moerl bench trainer-versions`: the async trainer's overhead per version on a (dp, ep) mesh
of gloo ranks, restarting the ranks every version (`run_policy_update`) against a mesh whose
ranks live for the run (one `ep_train.Session`, `ep_train.run_version` per version), side by
side in one run, on the same model and batches. Per version, overhead = wall -
`timing/trainer_steps_s`; the arms' versions are interleaved, and both arms' weights must
agree after every version (within `TOL`; the bench fails otherwise).

Design, details and limitations: docs/bench-reports/trainer-versions.md.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import envelope, format_table, write_report
from benchmarks.machine import machine_line
from moerl.errors import ConfigError, TrainingError

TOL = 1e-5  # float32, the same code on both arms: in practice bit for bit
ARMS = ("restart", "persistent")
WAIT_S = 1800.0  # the most one persistent-mesh command may take before the bench gives up


def parse_mesh(text: str) -> tuple[int, int]:
    """`--mesh 2x2` -> (dp, ep); anything else is a one-line ConfigError."""
    try:
        dp, ep = (int(x) for x in text.lower().split("x"))
    except ValueError:
        dp = ep = 0
    if dp < 1 or ep < 1 or dp * ep < 2:
        raise ConfigError(
            f"bench trainer-versions --mesh: {text!r} is not allowed; give DPxEP, two positive "
            "integers with at least 2 ranks in all, e.g. 2x2 or 1x2"
        )
    return dp, ep


def synthetic_batch(n: int, seed: int) -> list:
    """`n` TrainSamples of random tokens, log-probs and alternating-sign advantages, seeded (the
    trainer tests' batch, one seed per version)."""
    import torch

    from moerl.records import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 3, 2 + i % 4
        ids = torch.randint(5, 20, (plen + rlen,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:plen],
                response_token_ids=ids[plen:],
                response_logprobs=(-torch.rand(rlen, generator=g) * 3).tolist(),
                advantage=(1.0 + i / 8) * (-1) ** i,
                policy_version=0,
            )
        )
    return out


def read_weights(folder: Path) -> dict[str, Any]:
    """A version's HF weights, whatever files hold them: one `model.safetensors`, or the files
    its `model.safetensors.index.json` names (each rank's part of the mesh's export)."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    out: dict[str, Any] = {}
    for f in sorted(set(weight_map.values())):
        out.update(load_file(folder / f))
    if set(out) != set(weight_map):
        raise TrainingError(f"bench trainer-versions: {index} and its files name other tensors")
    return out


def max_abs_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest |a - b| over every tensor (float32); the names must agree."""
    if set(a) != set(b):
        raise TrainingError(
            f"bench trainer-versions: the arms wrote other tensors: {sorted(set(a) ^ set(b))[:5]}"
        )
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def bench_config(
    dp: int, ep: int, steps: int = 2, model: dict[str, int] | None = None, micro_batch: int = 24
):
    """The run config both arms train with: the default config on a (dp, ep) mesh of the local
    launcher (gloo), `steps` optimizer steps per version, the tiny MoE with `model` overrides."""
    from moerl.config import parse_config

    return parse_config(
        {
            "model": {"tiny": dict(model or {})},
            "trainer": {
                "optimizer": {"optimizer_steps_per_iteration": steps, "learning_rate": 0.003},
                "parallelism": {
                    "micro_batch_tokens": micro_batch,
                    "expert_parallel_size": ep,
                    "data_parallel_shard": dp,
                    "launcher": "local",
                },
            },
        }
    )


# ---- the persistent arm: ranks spawned once, commands through queues ---------------------------


def _mesh_rank(
    rank: int, world: int, cfg_json: str, state_in: str, rendezvous: str, commands, results
) -> None:
    """One rank of the persistent arm (torch.multiprocessing spawn): join the process group as
    a restarting rank does, load the session once, then run each version rank 0 is told to."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MOERL_INIT_METHOD=f"file://{rendezvous}",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),  # as the launcher's ranks
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from moerl.components.policy_update.ep_train import Session, join_process_group, run_version
    from moerl.config import config_from_json
    from moerl.records import TrainSample, read_records

    cfg = config_from_json(cfg_json)
    join_process_group(cfg)
    try:
        t0 = time.perf_counter()
        session = Session.load(cfg, Path(state_in))
        loads = 1
        dist.barrier()
        if rank == 0:
            results.put(
                {"op": "loaded", "load_s": time.perf_counter() - t0, "loaded_at": time.time()}
            )
        while True:
            cmd = commands.get()
            if cmd["op"] == "stop":
                return
            before = loads
            dist.barrier()
            t0 = time.perf_counter()
            batch = read_records(cmd["batch"], TrainSample)
            metrics = run_version(cfg, session, batch, cmd["iteration"], Path(cmd["out"]))
            dist.barrier()
            wall = time.perf_counter() - t0
            if rank == 0:
                results.put(
                    {"op": "version", "wall_s": wall, "loads": loads - before, "metrics": metrics}
                )
    except BaseException as err:
        if rank == 0:
            results.put({"op": "error", "error": f"{type(err).__name__}: {err}"[:2000]})
        raise
    finally:
        dist.destroy_process_group()


class PersistentMesh:
    """The persistent arm's ranks, spawned once; `version` runs one version on all of them."""

    def __init__(self, cfg, state_in: Path, work: Path) -> None:
        import torch.multiprocessing as mp

        from moerl.config import config_to_json

        world = cfg.trainer.parallelism.world_size
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(world)]  # one per rank
        self.results = ctx.Queue()  # rank 0's
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        self.procs = [
            ctx.Process(
                target=_mesh_rank,
                args=(
                    r,
                    world,
                    config_to_json(cfg),
                    str(state_in),
                    str(work / "rendezvous"),
                    self.commands[r],
                    self.results,
                ),
                daemon=True,
            )
            for r in range(world)
        ]
        for p in self.procs:
            p.start()
        try:
            loaded = self._result("loaded")
        except BaseException:
            self.close()
            raise
        # the one-time cost: spawn, process group, mesh, every rank's load, as rank 0 saw it end
        self.start_s = loaded["loaded_at"] - t0
        self.load_s = loaded["load_s"]

    def _result(self, op: str) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                res = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [(i, p.exitcode) for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise TrainingError(
                        f"bench trainer-versions: persistent ranks exited (rank, code): {dead}"
                    ) from None
                if time.monotonic() > deadline:
                    raise TrainingError(
                        f"bench trainer-versions: the persistent mesh did not answer {op!r} "
                        f"within {WAIT_S:g} s"
                    ) from None
                continue
            if res["op"] == "error":
                raise TrainingError(f"bench trainer-versions: persistent rank 0: {res['error']}")
            return res

    def version(self, batch: Path, iteration: int, out: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        for q in self.commands:
            q.put({"op": "version", "batch": str(batch), "iteration": iteration, "out": str(out)})
        res = self._result("version")
        res["outer_wall_s"] = time.perf_counter() - t0
        return res

    def close(self) -> None:
        for q in self.commands:
            try:
                q.put({"op": "stop"})
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=30)
        for p in self.procs:  # a rank stuck in a collective after another failed
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for q in (*self.commands, self.results):
            q.close()
            q.join_thread()


# ---- the bench ----------------------------------------------------------------------------------


def _row(arm: str, repeat: int, version: int, wall: float, metrics: dict, loads: int) -> dict:
    steps = metrics["timing/trainer_steps_s"]
    load = metrics.get("timing/trainer_load_s", 0.0)
    save = metrics.get("timing/trainer_save_s", 0.0)
    return {
        "arm": arm,
        "repeat": repeat,
        "version": version,
        "wall_s": wall,
        "steps_s": steps,
        "overhead_s": wall - steps,
        "non_training_fraction": (wall - steps) / wall,
        "load_s": load,
        "save_s": save,
        # spawn, imports, process group, mesh, exit (restart); barriers, the batch (persistent)
        "other_s": wall - steps - load - save,
        "session_loads": loads,
        "train_steps": metrics.get("train/steps"),
        "timing": {k: v for k, v in metrics.items() if k.startswith("timing/")},
    }


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(rows: list[dict], one_time: list[dict]) -> dict[str, Any]:
    """Per arm the medians over every version of every repeat; the restart / persistent ratios
    (overall, and per repeat); the persistent arm's one-time start + load."""
    arms: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        arms[arm] = {
            "versions": len(mine),
            **{
                f"median_{k}": _median(mine, k)
                for k in (
                    "wall_s",
                    "steps_s",
                    "overhead_s",
                    "non_training_fraction",
                    "load_s",
                    "save_s",
                    "other_s",
                )
            },
            "session_loads_per_version": max(r["session_loads"] for r in mine),
        }
    rs, ps = arms["restart"], arms["persistent"]
    per_repeat = []
    for rep in sorted({r["repeat"] for r in rows}):
        a = [r for r in rows if r["repeat"] == rep and r["arm"] == "restart"]
        b = [r for r in rows if r["repeat"] == rep and r["arm"] == "persistent"]
        per_repeat.append(_median(a, "overhead_s") / _median(b, "overhead_s"))
    start = statistics.median(o["start_s"] for o in one_time)
    return {
        "arms": arms,
        "overhead_ratio": rs["median_overhead_s"] / ps["median_overhead_s"],
        "overhead_ratio_per_repeat": per_repeat,
        "wall_ratio": rs["median_wall_s"] / ps["median_wall_s"],
        "persistent_one_time": {
            "median_start_s": start,
            "median_load_s": statistics.median(o["load_s"] for o in one_time),
            # the one-time start in restart versions' overheads: what it costs, once
            "in_restart_overheads": start / rs["median_overhead_s"],
        },
    }


def format_summary(rep: dict[str, Any]) -> str:
    """The plain-text table (one row per arm) and the ratio lines."""
    s = rep["summary"]
    rows = []
    for arm in ARMS:
        a = s["arms"][arm]
        rows.append(
            [
                arm,
                a["versions"],
                a["median_wall_s"],
                a["median_steps_s"],
                a["median_overhead_s"],
                a["median_load_s"],
                a["median_save_s"],
                a["median_other_s"],
                f"{100 * a['median_non_training_fraction']:.1f} %",
            ]
        )
    one = s["persistent_one_time"]
    dp, ep = rep["mesh"]
    lines = [
        format_table(
            [
                "arm",
                "versions",
                "wall s",
                "steps s",
                "overhead s",
                "load s",
                "save s",
                "other s",
                "not training",
            ],
            rows,
        ),
        "",
        f"overhead per version, restart / persistent: {s['overhead_ratio']:.1f}x "
        f"(per repeat: {', '.join(f'{x:.1f}x' for x in s['overhead_ratio_per_repeat'])}); "
        f"wall per version: {s['wall_ratio']:.1f}x",
        f"persistent, once: start + load {one['median_start_s']:.2f} s (load "
        f"{one['median_load_s']:.2f} s) = {one['in_restart_overheads']:.2f} restart overheads",
        f"weights: both arms agree after every version (max |diff| "
        f"{rep['weights']['max_abs_diff']:.2e} <= {TOL:g}; moved {rep['weights']['moved']:.2e} "
        f"from the start)"
        if rep["ok"]
        else f"weights: the arms DISAGREE (max |diff| {rep['weights']['max_abs_diff']:.2e} > "
        f"{TOL:g}) or did not move ({rep['weights']['moved']:.2e})",
        f"mesh (dp, ep) = ({dp}, {ep}), {dp * ep} gloo ranks; {rep['versions_per_arm']} versions x "
        f"{rep['repeats']} repeats; medians over every version",
    ]
    return "\n".join(lines)


def run_bench_trainer_versions(
    out_dir: Path = Path("bench/trainer-versions"),
    versions: int = 4,
    repeats: int = 1,
    mesh: str | tuple[int, int] = "2x2",
    steps: int = 2,
    samples: int = 16,
    model: dict[str, int] | None = None,
    work_dir: Path | None = None,
    echo=print,
    hidden: int | None = None,
    layers: int | None = None,
    experts: int | None = None,
    moe_intermediate_size: int | None = None,
) -> dict[str, Any]:
    """Both arms, interleaved by version, `repeats` times; report.json and summary.md in
    `out_dir`; the summary printed. Raises TrainingError (after writing the report) when the
    arms' weights disagree after any version or training did not move them.

    Args:
        out_dir: report.json, summary.md
        versions: versions per arm and repeat
        repeats: rounds of both arms (a new persistent mesh each); which arm runs a version
            first alternates by version and by round
        mesh: DPxEP (gloo ranks on this machine)
        steps: optimizer steps per version
        samples: samples per version's batch
        work_dir: keep every version's files here (default: a temp dir)
        hidden: tiny MoE hidden size (default 128), over `model`
        layers: tiny MoE layers (default 2)
        experts: routed experts (default 8)
        moe_intermediate_size: each expert's intermediate size (default 64)
    """
    from moerl.components.policy_update.trainer import run_policy_update
    from moerl.models.tiny import build_tiny_model
    from moerl.records import write_records

    dp, ep = parse_mesh(mesh) if isinstance(mesh, str) else mesh
    sizes = {
        "hidden_size": hidden,
        "num_layers": layers,
        "num_experts": experts,
        "moe_intermediate_size": moe_intermediate_size,
    }
    model = {**(model or {}), **{k: v for k, v in sizes.items() if v is not None}}
    world = dp * ep
    for name, value, least in (
        ("--versions", versions, 1),
        ("--repeats", repeats, 1),
        ("--steps", steps, 1),
        ("--samples", samples, world),
    ):
        if value < least:
            raise ConfigError(
                f"bench trainer-versions {name}: {value}; allowed: an integer >= {least}"
                + (" (every rank needs a sample)" if name == "--samples" else "")
            )
    cfg = bench_config(dp, ep, steps, model)  # a bad mesh or model: ConfigError
    out_dir = Path(out_dir)
    rows: list[dict[str, Any]] = []
    one_time: list[dict[str, Any]] = []
    diffs: list[dict[str, Any]] = []
    moved = 0.0
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="moerl-bench-trainer-versions-") as tmp:
        work = Path(work_dir) if work_dir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        s0 = build_tiny_model(cfg.model.tiny, work / "s0")
        w0 = read_weights(s0)
        n_params = sum(t.numel() for t in w0.values())
        batches = [work / "batches" / f"v{v + 1}.jsonl" for v in range(versions)]
        for v, path in enumerate(batches):
            write_records(path, synthetic_batch(samples, seed=1 + v))
        for rep in range(repeats):
            rdir = work / f"repeat{rep}"
            shutil.rmtree(rdir, ignore_errors=True)
            pm = PersistentMesh(cfg, s0, rdir / "mesh")
            one_time.append({"repeat": rep, "start_s": pm.start_s, "load_s": pm.load_s})
            echo(
                f"[moerl] repeat {rep + 1}/{repeats}: persistent mesh up in {pm.start_s:.2f} s "
                f"(load {pm.load_s:.2f} s)"
            )
            try:
                prev = s0
                for v in range(versions):
                    order = ARMS if (v + rep) % 2 == 0 else ARMS[::-1]
                    outs = {arm: rdir / arm / f"v{v + 1}" for arm in ARMS}
                    got: dict[str, dict] = {}
                    for arm in order:
                        if arm == "restart":
                            t0 = time.perf_counter()
                            m = run_policy_update(cfg, batches[v], prev, outs[arm], v)
                            wall = time.perf_counter() - t0
                            got[arm] = _row(arm, rep, v + 1, wall, m, 1)
                        else:
                            res = pm.version(batches[v], v, outs[arm])
                            got[arm] = _row(
                                arm, rep, v + 1, res["wall_s"], res["metrics"], res["loads"]
                            )
                            got[arm]["outer_wall_s"] = res["outer_wall_s"]
                    prev = outs["restart"]
                    rows += [got[a] for a in ARMS]
                    diff = max_abs_diff(
                        read_weights(outs["restart"]), read_weights(outs["persistent"])
                    )
                    diffs.append({"repeat": rep, "version": v + 1, "max_abs_diff": diff})
                    echo(
                        f"[moerl] repeat {rep + 1}/{repeats} version {v + 1}/{versions}: "
                        + "; ".join(
                            f"{a} {got[a]['wall_s']:.2f} s (steps {got[a]['steps_s']:.2f} s)"
                            for a in order
                        )
                        + f"; weights |diff| {diff:.1e}"
                    )
                moved = max(moved, max_abs_diff(w0, read_weights(prev)))
            finally:
                pm.close()
    max_diff = max(d["max_abs_diff"] for d in diffs)
    ok = max_diff <= TOL and moved > TOL
    report = envelope(
        "trainer-versions",
        ok,
        mesh=[dp, ep],
        versions_per_arm=versions,  # "versions" is the envelope's (what it ran on)
        repeats=repeats,
        optimizer_steps_per_version=steps,
        samples_per_version=samples,
        model={**cfg.model.tiny.model_dump(), "parameters": n_params},
        summary=summarize(rows, one_time),
        weights={"tolerance": TOL, "max_abs_diff": max_diff, "moved": moved, "per_version": diffs},
        persistent_one_time=one_time,
        rows=rows,
        elapsed_s=time.perf_counter() - t_all,
    )
    text = format_summary(report)
    write_report(out_dir / "report.json", report)
    (out_dir / "summary.md").write_text(
        "# moerl bench trainer-versions\n\nThe async trainer's overhead per version (wall - "
        "optimizer steps): restarting the ranks every version (`run_policy_update`) against "
        "ranks spawned once (`ep_train.Session` loaded once, `run_version` per version), "
        "interleaved by version.\n\n```\n"
        + text
        + "\n```\n\n"
        + machine_line(report["machine"])
        + "\n"
    )
    echo(text)
    echo(f"wrote {out_dir / 'report.json'} and {out_dir / 'summary.md'}")
    if not ok:
        raise TrainingError(
            f"bench trainer-versions: the arms' weights differ by up to {max_diff:.2e} (allowed "
            f"{TOL:g}) or training did not move them ({moved:.2e}); see {out_dir / 'report.json'}"
        )
    return report
