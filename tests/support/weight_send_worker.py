"""Jobs for tests/rollout/test_weight_sync.py on a gloo world (tests/support/gloo_world.py): one
rank of a (dp, ep) trainer mesh, the policy loaded sharded as the trainer loads it (FSDP2 on the
mesh), which joins its group of the collective weight path and sends versions to live engines.

Each version perturbs every rank's own shard (different per rank and version, so a misplaced
row shows), writes the durable copy (`export_ep_checkpoint`, every rank its files) and sends the
same version over the wire (`ep_send.WeightSender`). Every rank's counts come back to the test.
"""

from __future__ import annotations

import os
import signal
import threading
import zlib
from pathlib import Path

import torch

SEND_BUCKET_BYTES = 64_000  # small: several frames per rank and version


def _perturb(model, rank: int, version: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            seed = zlib.crc32(name.encode()) + 1000 * rank + 100_000 * version
            g = torch.Generator().manual_seed(seed)
            local.add_(0.01 * torch.randn(local.shape, generator=g))


def _load(ckpt: str, dp: int, ep: int):
    from transformers import AutoConfig

    from moerl.components.policy_update.ep_checkpoint import load_ep_model
    from moerl.components.policy_update.ep_train import apply_fsdp, build_mesh
    from moerl.config import parse_config
    from moerl.kernels import make_dispatcher
    from moerl.models.families import family_of

    cfg = parse_config(
        {"trainer": {"parallelism": {"expert_parallel_size": ep, "data_parallel_shard": dp}}}
    )
    mesh = build_mesh(cfg)
    hf = AutoConfig.from_pretrained(ckpt)
    dispatcher = make_dispatcher(
        "all_to_all", num_experts=family_of(hf).num_experts(hf), group=mesh.get_group("ep")
    )
    model, blocks, layout = load_ep_model(
        ckpt, dispatcher, torch.float32, "cpu", shard=lambda m, b: apply_fsdp(m, b, mesh)
    )
    return mesh, model, blocks, layout


def send_versions(
    rank: int,
    world: int,
    dp: int,
    ep: int,
    ckpt: str,
    ports: list[int],
    engine_ranks: int,
    versions: list[int],
    out_dir: str,
    kill: dict | None = None,
    timeout_s: float = 60.0,
    backend: str | None = None,
):
    """Join this rank's group, then per version: perturb, export the durable copy to
    out_dir/v<version>, send it. `kill` {"rank", "version", "after_frames"}: that rank SIGKILLs
    itself once it has sent that many frames of that version (a trainer killed mid-send)."""
    from moerl.components.policy_update.ep_export import expected_keys, export_ep_checkpoint
    from moerl.components.policy_update.ep_send import WeightSender
    from moerl.components.redistribute_weights import wire

    mesh, model, blocks, layout = _load(ckpt, dp, ep)
    sender = WeightSender(
        wire.GroupAddress("127.0.0.1", ports[rank], 1 + engine_ranks), "cpu", timeout_s, backend
    )
    sender.join()
    out = []
    try:
        for v in versions:
            _perturb(model, rank, v)
            export = export_ep_checkpoint(
                model, blocks, layout, Path(ckpt), Path(out_dir) / f"v{v}", mesh
            )
            if kill and kill["rank"] == rank and kill["version"] == v:
                _arm_kill(kill["after_frames"])
            stats = sender.send(
                model, blocks, layout, mesh, wire.Session(v, f"sha-v{v}"), None, SEND_BUCKET_BYTES
            )
            out.append(
                {
                    "version": v,
                    "sent": stats.bytes,
                    "tensors": stats.tensors,
                    "frames": stats.frames,
                    "keys": stats.keys,
                    "written": export.bytes_written[rank],
                    "received": stats.received,
                    "export_received": export.bytes_received[rank],
                    "total": export.total_bytes,
                    "expected": sorted(expected_keys(blocks, layout)),
                }
            )
    finally:
        sender.close()
    return out


def _arm_kill(after_frames: int) -> None:
    """SIGKILL this process once `after_frames` frames of the next send went out."""
    from moerl.components.redistribute_weights import wire

    original = wire.FrameSender._frame
    count = {"n": 0}

    def frame(self, kind, header, payload):
        if count["n"] >= after_frames:
            os.kill(os.getpid(), signal.SIGKILL)
        count["n"] += 1
        return original(self, kind, header, payload)

    wire.FrameSender._frame = frame  # type: ignore[method-assign]


# -- the test process's side ---------------------------------------------------------------------


def on_all(fn, engines) -> list:
    """fn(engine index, engine) on every engine at once (the engines of a session join and
    receive together); the results, or the first error raised."""
    results: list = [None] * len(engines)
    errors: list[BaseException] = []

    def run(i, eng):
        try:
            results[i] = fn(i, eng)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "an engine's call did not return in 300 s"
    if errors:
        raise errors[0]
    return results


class Trainer:
    """`send_versions` on a gloo world of dp x ep ranks, in a thread (it blocks until every
    version is sent); `join_engines` joins the engines to its groups."""

    def __init__(
        self, world, mesh, engine_ranks, ckpt, versions, out, kill=None, backend=None
    ) -> None:
        from moerl.components.redistribute_weights import wire

        dp, ep = mesh
        self.backend = backend
        self.ports = [wire.free_port() for _ in range(dp * ep)]
        self.groups = [wire.GroupAddress("127.0.0.1", p, 1 + engine_ranks) for p in self.ports]
        self.result: list | None = None
        self.error: BaseException | None = None
        args = (
            dp,
            ep,
            str(ckpt),
            self.ports,
            engine_ranks,
            versions,
            str(out),
            kill,
            60.0,
            backend,
        )

        def run() -> None:
            try:
                self.result = world.run(send_versions, *args, timeout_s=300)
            except BaseException as err:  # noqa: BLE001 - the test reads it
                self.error = err

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join_engines(self, engines, ranks_per_engine: int) -> None:
        on_all(
            lambda i, e: e.join_weight_groups(
                self.groups, i * ranks_per_engine, 60.0, self.backend
            ),
            engines,
        )

    def wait(self) -> list:
        self.thread.join(timeout=300)
        assert not self.thread.is_alive(), "the trainer job did not finish in 300 s"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]


def probe(engine) -> list[float]:
    """Greedy tokens' and the prompt's logprobs for one fixed prompt: equal on two engines only
    when their weights are."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    o = out.outputs[0]
    gen = [step[t].logprob for step, t in zip(o.logprobs, o.token_ids)]
    return gen + [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
