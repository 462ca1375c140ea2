"""Start the expert-parallel ranks of the policy update and wait for them.

`run_expert_parallel` starts `trainer.expert_parallel_size` ranks of
`moerl.components.policy_update.ep_train` (gloo on CPU, NCCL on GPU) on this machine, with
torchrun or as local processes meeting through a file store (`trainer.launcher`), waits for
all of them, and returns rank 0's metrics. If one rank fails, the others are killed: they would
block in a collective forever.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from moerl.config import RunConfig
from moerl.errors import TrainingError

log = logging.getLogger(__name__)


def _wait_all_or_kill(procs) -> int:
    """Wait for every rank; if one fails, kill the others (they would block in a collective
    forever) and return its exit code."""
    while True:
        codes = [p.poll() for p in procs]
        failed = next((c for c in codes if c not in (None, 0)), None)
        if failed is not None:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            return failed
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def run_expert_parallel(cfg: RunConfig, batch_path: str | Path, state_in: str | Path, state_out: str | Path,
                        iteration: int) -> dict[str, float]:
    """Start `trainer.expert_parallel_size` ranks of ep_train (gloo on CPU, NCCL on GPU) on this
    machine, with torchrun or as local processes meeting through a file store (see
    `trainer.launcher`), wait for all, and return rank 0's metrics."""
    import socket
    import subprocess
    import sys
    import tempfile

    from moerl.config import config_to_json

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="moerl-ep-") as tmp:
        (Path(tmp) / "config.json").write_text(config_to_json(cfg))
        ws = cfg.trainer.expert_parallel_size
        args = ["-m", "moerl.components.policy_update.ep_train",
                "--config-json", f"{tmp}/config.json", "--batch", str(batch_path), "--state-in", str(state_in),
                "--state-out", str(state_out), "--iteration", str(iteration), "--metrics-out", f"{tmp}/metrics.json"]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        if cfg.trainer.launcher == "torchrun":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={ws}",
                   "--master-addr=127.0.0.1", f"--master-port={port}", *args[1:]]
            returncode = subprocess.run(cmd, env=env).returncode
        else:
            procs = [subprocess.Popen([sys.executable, *args], env={
                **env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(ws), "LOCAL_WORLD_SIZE": str(ws),
                "MOERL_INIT_METHOD": f"file://{tmp}/rendezvous"}) for r in range(ws)]
            returncode = _wait_all_or_kill(procs)
        if returncode != 0:
            raise TrainingError(f"policy_update: expert-parallel training ({cfg.trainer.launcher}, {ws} ranks, "
                                f"{cfg.trainer.ep_backend}) exited with {returncode}; see the ranks' output above")
        out = json.loads((Path(tmp) / "metrics.json").read_text())
    if out["fallback_from"]:
        log.warning("expert-parallel dispatcher fell back from %s to %s", out["fallback_from"], out["dispatcher"])
    return out["metrics"]
