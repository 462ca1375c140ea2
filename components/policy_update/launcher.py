"""Start the ranks of the policy update's mesh and wait for them.

Design, details and limitations: docs/async.md#componentspolicy_updatelauncherpy.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from moerl.config import RunConfig, config_to_json
from moerl.errors import TrainingError
from moerl.launch import procs
from moerl.launch.nodes import NodeGroup, node_group

log = logging.getLogger(__name__)

EP_MODULE = "moerl.components.policy_update.ep_train"
MESH_MODULE = "moerl.components.policy_update.mesh"
# torchrun turns SIGTERM into an orderly stop of its workers; give it this long before SIGKILL.
TORCHRUN_GRACE_S = 10.0


class RankTimeout(TrainingError):
    """The ranks did not all finish within the rank timeout."""


def _wait_all_or_kill(ranks: list[subprocess.Popen], timeout_s: float, grace_s: float = 0.0) -> int:
    """Wait for every rank and return 0, or the first failed rank's exit code after killing
    the others (they would block in a collective forever). Past `timeout_s`, kill all and
    raise RankTimeout. Every rank's process group is killed on the way out, whatever the way."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p in ranks]
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                return failed
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                raise RankTimeout(
                    f"did not finish within {timeout_s:g} s (the rank timeout); killed every rank"
                )
            time.sleep(0.2)
    finally:
        procs.kill_groups(ranks, grace_s=grace_s if any(p.poll() is None for p in ranks) else 0.0)


def _rank_args(
    cfg_path: Path, batch_path, state_in, state_out, iteration: int, metrics_path: Path
) -> list[str]:
    return [
        "--config-json",
        str(cfg_path),
        "--batch",
        str(batch_path),
        "--state-in",
        str(state_in),
        "--state-out",
        str(state_out),
        "--iteration",
        str(iteration),
        "--metrics-out",
        str(metrics_path),
    ]


def torchrun_args(
    world_size: int, rank_args: list[str], nodes: NodeGroup | None = None, module: str = EP_MODULE
) -> list[str]:
    """torchrun's arguments, each worker run through the `moerl.launch.procs` wrapper so it dies
    with torchrun. One node: a standalone rendezvous on a port the store picks itself. Several
    (`nodes`, from Trainer's PET_* variables): this node's share of the ranks, meeting the
    others in a static rendezvous at node 0's address (node 0's torchrun hosts the store)."""
    if nodes is None:
        head = [
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={world_size}",
            "--local-addr=127.0.0.1",
        ]
    else:
        if world_size % nodes.size:
            raise TrainingError(
                f"policy_update: {world_size} ranks do not split evenly over {nodes.size} nodes"
            )
        head = [
            f"--nnodes={nodes.size}",
            f"--node-rank={nodes.rank}",
            f"--nproc-per-node={world_size // nodes.size}",
            f"--master-addr={nodes.master_addr}",
            f"--master-port={nodes.master_port}",
        ]
    return [*head, "--module", "moerl.launch.procs", module, *rank_args]


def _start(
    cfg: RunConfig,
    tmp: Path,
    rank_args: list[str],
    nodes: NodeGroup | None = None,
    module: str = EP_MODULE,
) -> tuple[list[subprocess.Popen], float]:
    """Start the ranks (or torchrun); returns them and the grace to give them on a kill."""
    ws = cfg.trainer.parallelism.world_size
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if nodes is None or nodes.loopback:  # gloo binds loopback, unless the ranks span real nodes
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if nodes is not None:
        if cfg.trainer.parallelism.launcher != "torchrun":
            raise TrainingError(
                f"policy_update: the trainer runs on {nodes.size} nodes, which only trainer.parallelism.launcher "
                f"torchrun can join (got {cfg.trainer.parallelism.launcher!r})"
            )
        return [
            procs.spawn("torch.distributed.run", torchrun_args(ws, rank_args, nodes, module), env)
        ], TORCHRUN_GRACE_S
    if cfg.trainer.parallelism.launcher == "torchrun":
        return [
            procs.spawn("torch.distributed.run", torchrun_args(ws, rank_args, None, module), env)
        ], TORCHRUN_GRACE_S
    ranks = []
    try:
        for r in range(ws):
            ranks.append(
                procs.spawn(
                    module,
                    rank_args,
                    {
                        **env,
                        "RANK": str(r),
                        "LOCAL_RANK": str(r),
                        "WORLD_SIZE": str(ws),
                        "LOCAL_WORLD_SIZE": str(ws),
                        "MOERL_INIT_METHOD": f"file://{tmp}/rendezvous",
                    },
                )
            )
    except BaseException:
        procs.kill_groups(ranks)
        raise
    return ranks, 0.0


def run_expert_parallel(
    cfg: RunConfig,
    batch_path: str | Path,
    state_in: str | Path,
    state_out: str | Path,
    iteration: int,
    rank_timeout_s: float | None = None,
) -> dict[str, float]:
    """Start `trainer.parallelism.expert_parallel_size` ranks of ep_train (gloo on CPU, NCCL on GPU) on this
    machine, with torchrun or as local processes meeting through a file store (see
    `trainer.parallelism.launcher`), wait for all, and return rank 0's metrics. The ranks are killed if
    they run past `rank_timeout_s` (default `trainer.parallelism.rank_timeout_s`: generous, since a real
    MoE update of many steps can take an hour, but a hung rank is caught the same day)."""
    timeout_s = rank_timeout_s or cfg.trainer.parallelism.rank_timeout_s
    tc = cfg.trainer
    nodes = node_group()
    where = f", node {nodes.rank} of {nodes.size}" if nodes else ""
    what = (
        f"sharded training ({tc.parallelism.launcher}, {tc.parallelism.world_size} ranks: mesh dp {tc.parallelism.data_parallel_shard} x ep "
        f"{tc.parallelism.expert_parallel_size}, {tc.parallelism.ep_backend}{where})"
    )
    with tempfile.TemporaryDirectory(prefix="moerl-ep-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "config.json").write_text(config_to_json(cfg))
        rank_args = _rank_args(
            tmp / "config.json", batch_path, state_in, state_out, iteration, tmp / "metrics.json"
        )
        try:
            with procs.sigterm_raises():
                ranks, grace_s = _start(cfg, tmp, rank_args, nodes)
                returncode = _wait_all_or_kill(ranks, timeout_s, grace_s)
        except RankTimeout as err:
            raise RankTimeout(f"policy_update: {what} {err}") from None
        except procs.Terminated:
            raise TrainingError(
                f"policy_update: received SIGTERM; killed every rank of {what}"
            ) from None
        if returncode != 0:
            raise TrainingError(
                f"policy_update: {what} exited with {returncode}; see the ranks' output above"
            )
        if nodes is not None and not nodes.leader:  # rank 0, which reports, is on node 0
            log.info("%s: this node's ranks finished", what)
            return {}
        out = json.loads((tmp / "metrics.json").read_text())
    if out["fallback_from"]:
        log.warning(
            "expert-parallel dispatcher fell back from %s to %s",
            out["fallback_from"],
            out["dispatcher"],
        )
    else:
        log.info("expert-parallel dispatcher: %s", out["dispatcher"])
    return out["metrics"]


def run_mesh_trainer(
    cfg: RunConfig,
    run_id: str,
    extra_args: list[str] | None = None,
    timeout_s: float | None = None,
) -> str:
    """The async trainer as one mesh for the whole run (`mesh.py`), or, with `extra_args`
    (`--policy-json`, `--batch`, `--iteration`), the sync update of one version (`update.py`):
    start its ranks once (on this node's share, `nodes` from the TrainJob's PET_* variables),
    wait for all of them, and return rank 0's result (JSON: the final PolicyVersion, or the
    published version and its metrics; "" on a node other than 0). `timeout_s`: every rank
    is killed past it (the sync update's `trainer.parallelism.rank_timeout_s`). Without it, no
    deadline on the whole: the run's length is the run's; a hung rank is bounded by the
    collectives' timeout, a silent controller by its heartbeat, a silent run by rank 0's stall
    watchdog. Any rank's failure kills every rank and raises with rank 0's exit code when it
    failed (the async orchestrator and KFP retry on it)."""
    nodes = node_group()
    tc = cfg.trainer.parallelism
    what = (
        f"the trainer mesh ({tc.launcher}, {tc.world_size} ranks: dp {tc.data_parallel_shard} x ep "
        f"{tc.expert_parallel_size}" + (f", node {nodes.rank} of {nodes.size})" if nodes else ")")
    )
    with tempfile.TemporaryDirectory(prefix="moerl-mesh-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "config.json").write_text(config_to_json(cfg))
        result = tmp / "result.json"
        rank_args = [
            "--config-json",
            str(tmp / "config.json"),
            "--run-id",
            run_id,
            "--result",
            str(result),
            *(extra_args or []),
        ]
        try:
            with procs.sigterm_raises():
                ranks, grace_s = _start(cfg, tmp, rank_args, nodes, MESH_MODULE)
                log.info("%s: started, pids %s", what, [p.pid for p in ranks])
                returncode = _wait_all_or_kill(ranks, timeout_s or float("inf"), grace_s)
        except RankTimeout as err:
            raise RankTimeout(f"trainer: {what} {err}") from None
        except procs.Terminated:
            raise TrainingError(f"trainer: received SIGTERM; killed every rank of {what}") from None
        if returncode != 0:
            from moerl.components.policy_update.mesh import result_code

            # rank 0's own code when it failed (torchrun reports 1 for any failed worker, and
            # another rank may exit first): a refused config is not retried
            returncode = mesh_exit_code(returncode, result_code(result), what)
            raise MeshFailed(
                returncode, f"trainer: {what} exited with {returncode}; see the ranks' output above"
            )
        return result.read_text() if result.is_file() else ""


def mesh_exit_code(first: int, code_file: Path, what: str) -> int:
    """The trainer's exit code from the first failed rank's code (`first`, non-zero): rank 0's
    own when it left one in `code_file` (a refused config is not retried); else 1 for a rank
    killed by a signal before rank 0 saw it fail (a lost peer, which a retry may survive: -N
    would read as 256-N), else `first`."""
    if code_file.is_file():
        return int(code_file.read_text().strip() or 1)
    if first < 0:
        log.error("%s: a rank was killed by signal %d; the trainer exits 1", what, -first)
        return 1
    return first


class MeshFailed(TrainingError):
    """A rank of the trainer mesh exited non-zero; `code` is its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = self.exit_code = code
