"""Inside a launched pod: `python -m moerl.launch.remote <spec-uri>` runs one stage.

Design, details and limitations: docs/launch.md#moerllaunchremotepy.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from moerl.config import CheckpointConfig, RunConfig, config_from_json
from moerl.errors import MoerlError
from moerl.launch.exchange import RESULT, SPEC, Exchange, node_result
from moerl.launch.nodes import node_group
from moerl.launch.objects import ENV_GROUP_SIZE, ENV_NODE_RANK, ENV_WORKER_INDEX
from moerl.launch.podenv import enter_pod
from moerl.records import PolicyVersion

log = logging.getLogger(__name__)

TERMINATION_LOG = "/dev/termination-log"
_TERMINATION_MAX = 4096  # what the kubelet keeps of a termination message


class RemoteError(MoerlError):
    """A launched pod could not run its spec (missing or malformed)."""


# A stage: (cfg, run_id, scalar args, input paths, output paths) -> a JSON-serializable value.
StageFn = Callable[[RunConfig, str, dict[str, Any], dict[str, Path], dict[str, Path]], Any]


# Each stage's entry point, by name: moerl.launch sits below the stages (docs/architecture.md,
# "Layers"), so it finds them where a launched pod runs one, never by importing them.
ENTRY_POINTS = {
    "policy_update": "moerl.components.policy_update.update:run_sync_update",
    "async_trainer": "moerl.components.policy_update.worker:run_async_trainer",
    "rollout": "moerl.components.rollout.stage:run_rollout",
    "rollout_worker": "moerl.components.rollout.worker:run_rollout_worker",
    "rollout_pod": "moerl.components.rollout.pod:run_rollout_pod",
    "rollout_follower": "moerl.components.rollout.follower:run_follower",
}


def entry_point(name: str) -> Callable[..., Any]:
    """The stage function `ENTRY_POINTS[name]` names, imported here, in the launched pod."""
    module, _, function = ENTRY_POINTS[name].partition(":")
    return getattr(importlib.import_module(module), function)


@dataclass(frozen=True)
class Stage:
    fn: StageFn
    group: Literal["trainer", "rollout"]  # which cluster group (and workload kind) runs it
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()


def _policy_update(
    cfg: RunConfig,
    run_id: str,
    args: dict[str, Any],
    inputs: dict[str, Path],
    outputs: dict[str, Path],
) -> Any:
    done = entry_point("policy_update")(
        cfg,
        run_id,
        PolicyVersion.model_validate_json(args["policy_json"]),
        inputs["batch"],
        int(args["iteration"]),
    )
    if done is None:  # a node other than the first: rank 0's node reports
        return None
    return {"policy_json": done[0].model_dump_json(), "metrics": done[1]}


def _async_trainer(
    cfg: RunConfig,
    run_id: str,
    args: dict[str, Any],
    inputs: dict[str, Path],
    outputs: dict[str, Path],
) -> Any:
    return entry_point("async_trainer")(cfg, run_id)


def _rollout(
    cfg: RunConfig,
    run_id: str,
    args: dict[str, Any],
    inputs: dict[str, Path],
    outputs: dict[str, Path],
) -> Any:
    policy = PolicyVersion.model_validate_json(args["policy_json"])
    return entry_point("rollout")(cfg, run_id, policy, int(args["iteration"]), outputs["samples"])


class FollowerFailed(MoerlError):
    """A follower node of a rollout engine group ended without finishing the run (a drain, a
    failure): its pod fails with that exit code, which fails the group's JobSet."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def group_rank(environ: MutableMapping[str, str] | None = None) -> int | None:
    """This pod's node rank in a rollout engine group (`objects.rollout_group`), or None
    outside one. The leader pod has MOERL_NODE_RANK 0; a worker pod has its Job completion
    index as MOERL_WORKER_INDEX, and is node rank index + 1, which this sets as
    MOERL_NODE_RANK (the follower and the leader's engine read it there)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_NODE_RANK)
    if raw is None and env.get(ENV_WORKER_INDEX) is not None:
        try:
            raw = str(int(env[ENV_WORKER_INDEX]) + 1)
        except ValueError:
            raise RemoteError(
                f"{ENV_WORKER_INDEX}={env[ENV_WORKER_INDEX]!r}: a group's worker pod needs its "
                "Job completion index"
            ) from None
        env[ENV_NODE_RANK] = raw
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        raise RemoteError(f"{ENV_NODE_RANK}={raw!r} is not a node rank") from None
    size = env.get(ENV_GROUP_SIZE)
    if rank < 0 or (size is not None and size.isdigit() and rank >= int(size)):
        raise RemoteError(f"{ENV_NODE_RANK}={rank} is outside the group ({ENV_GROUP_SIZE}={size})")
    return rank


def _rollout_worker(
    cfg: RunConfig,
    run_id: str,
    args: dict[str, Any],
    inputs: dict[str, Path],
    outputs: dict[str, Path],
) -> Any:
    rank = group_rank()
    if rank is not None:  # one node of an engine group over several nodes
        worker = str(args["worker"])
        if rank == 0:  # the leader: the moerl worker, which drives the whole DP x EP engine
            return entry_point("rollout_worker")(cfg, run_id, worker)
        # a follower: headless engine ranks; its exit code is its pod's (the leader reports)
        code = int(entry_point("rollout_follower")(cfg, run_id, worker))
        if code != 0:
            raise FollowerFailed(
                f"follower node {rank} of rollout group {worker} exited {code}", code
            )
        return code
    if "pod" in args:  # the pod's workers, one engine each on its own GPUs
        return entry_point("rollout_pod")(cfg, run_id, int(args["pod"]))
    return entry_point("rollout_worker")(cfg, run_id, str(args["worker"]))


STAGES: dict[str, Stage] = {
    "policy_update": Stage(_policy_update, "trainer", inputs=("batch",)),
    "async_trainer": Stage(_async_trainer, "trainer"),
    "rollout": Stage(_rollout, "rollout", outputs=("samples",)),
    "rollout_worker": Stage(_rollout_worker, "rollout"),
}


def run_spec(
    spec_uri: str,
    endpoint_url: str | None = None,
    region: str | None = None,
    workdir: Path | None = None,
) -> Any:
    """Steps 1-4 of the module docstring; returns the stage's value."""
    if not spec_uri.startswith("s3://") or not spec_uri.endswith(f"/{SPEC}"):
        raise RemoteError(f"expected s3://.../{SPEC}, got {spec_uri!r}")
    uri = spec_uri[: -len(SPEC) - 1]
    # 1. the spec, read with the given endpoint; everything after with the run's S3 settings
    spec = Exchange(
        CheckpointConfig(uri=uri, endpoint_url=endpoint_url, region=region), uri
    ).read_json(SPEC)
    if not isinstance(spec, dict):
        raise RemoteError(
            f"{spec_uri} does not exist or is not a JSON object; was the task's exchange deleted?"
        )
    try:
        stage = STAGES[spec["stage"]]
        cfg = config_from_json(spec["config_json"])
        run_id, args = str(spec["run_id"]), dict(spec["args"])
        input_descs, output_names = dict(spec["inputs"]), list(spec["outputs"])
    except (KeyError, TypeError, ValueError) as e:
        raise RemoteError(f"{spec_uri} is not a valid spec ({type(e).__name__}: {e})") from e
    ex = Exchange(
        cfg.checkpoint.model_copy(update={"endpoint_url": endpoint_url, "region": region}), uri
    )
    local = Path(tempfile.mkdtemp(prefix="moerl-exchange-", dir=workdir))
    # 2. inputs
    inputs = {
        name: ex.get(f"inputs/{name}", desc, local / "inputs" / name)
        for name, desc in input_descs.items()
    }
    outputs = {name: local / "outputs" / name for name in output_names}
    (local / "outputs").mkdir(parents=True)
    # 3. the stage
    log.info("running stage %s of run %s", spec["stage"], run_id)
    value = stage.fn(cfg, run_id, args, inputs, outputs)
    # 4. outputs, then the result that says they are complete (node 0's, or this node's part)
    result = {
        "value": value,
        "outputs": {name: ex.put(f"outputs/{name}", path) for name, path in outputs.items()},
    }
    rank = group_rank() if spec["stage"] == "rollout_worker" else None
    if rank:  # a rollout group's follower: the leader's result is the group's
        return value
    group = node_group()
    if group is None or group.leader:
        ex.write_json(RESULT, {**result, "nodes": group.size if group else 1})
    else:
        ex.write_json(node_result(group.rank), {"outputs": result["outputs"]})
    return value


def termination_message(text: str, path: str | None = None) -> bool:
    """Write `text` to the container's termination log, which the kubelet creates in every
    container (never created here: outside a pod there is none, and the log has the error)."""
    try:
        fd = os.open(path or TERMINATION_LOG, os.O_WRONLY | os.O_TRUNC)  # no O_CREAT
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text[-_TERMINATION_MAX:])
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m moerl.launch.remote", description=__doc__.split("\n")[0]
    )
    ap.add_argument("spec_uri", help="s3://.../exchange/<key>/spec.json")
    ap.add_argument(
        "--endpoint-url", default=None, help="S3-compatible endpoint (checkpoint.endpoint_url)"
    )
    ap.add_argument("--region", default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    enter_pod()  # the scratch emptyDir: working directory, HOME, TMPDIR, the checkpoint cache
    try:
        run_spec(a.spec_uri, a.endpoint_url, a.region, Path.cwd())
    except MoerlError as e:
        log.error("%s", e)
        termination_message(f"{type(e).__name__}: {e}")
        return e.exit_code
    except Exception as e:  # noqa: BLE001 (a bug: keep the traceback in the log, say it in the status)
        log.exception("stage failed")
        termination_message(f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
