"""What every vLLM worker of a rollout engine runs, called by name: vLLM mixes `MoerlWorker`
into each worker (`worker_extension_cls`) and `collective_rpc("moerl_...")` runs the method on
every rank, the engine's one worker or one per device (tensor / data parallel). Nothing is
pickled, so no insecure-serialization flag: only names and plain arguments cross processes.

- `moerl_swap`: the hot swap (redistribute_weights/hotswap.py) of this rank's shard of a
  verified node-cache copy, read through vLLM's weight loaders; returns the version it loaded and
  a digest of its parameters, which `RolloutEngine.swap_weights` compares across ranks.
- `moerl_transfer_report`: after a collective session (redistribute_weights/collective.py, the
  "moerl" weight-transfer backend this module registers with vLLM), what this rank loaded.
- `moerl_param_digests`: a checksum of every parameter of this rank (tests, audits).
- `moerl_routes_*`: live route capture (rollout.return_routed_experts on CPU); only the first
  rank records, since every tensor-parallel rank routes the same tokens.
"""

from __future__ import annotations

import hashlib
import os
from functools import partial
from typing import Any

import numpy as np

# elements per chunk of a parameter's checksum: bounds the temporaries on a device
_CHUNK = 1 << 24


def param_digest(t) -> str:
    """A value- and position-sensitive checksum of one tensor's bytes, computed where it lives
    (a GPU parameter is not copied to the host): the sums of its 32-bit words, plain and weighted
    by position modulo a prime, in int64 arithmetic (wrapping), with its shape and dtype."""
    import torch

    x = t.detach().contiguous().view(-1)
    raw = x.view(torch.uint8)
    if raw.numel() % 4 == 0:
        words = raw.view(torch.int32).to(torch.int64)
    else:
        words = raw.to(torch.int64)
    plain = torch.zeros((), dtype=torch.int64, device=words.device)
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), _CHUNK):
        w = words[lo : lo + _CHUNK]
        pos = torch.arange(lo, lo + w.numel(), device=w.device, dtype=torch.int64) % 65521 + 1
        plain += w.sum()
        weighted += (w * pos).sum()
    return f"{tuple(t.shape)}:{t.dtype}:{int(plain)}:{int(weighted)}"


def _ranks(worker) -> dict[str, int]:
    """This worker's place in the engine: global rank, tensor- and data-parallel ranks."""
    pc = worker.vllm_config.parallel_config
    tp = int(pc.tensor_parallel_size)
    rank = int(getattr(worker, "rank", 0))
    # the engine core's place among the data-parallel engine cores (vLLM 0.32 keeps it in
    # data_parallel_index even where a dense model's cores run as independent DP = 1 engines)
    dp = getattr(pc, "data_parallel_index", None)
    if dp is None:
        dp = getattr(pc, "data_parallel_rank", 0) or 0
    dp = int(dp)
    return {"rank": rank, "tp_rank": rank % tp, "dp_rank": dp}


class _Capture:
    """The route capture state inside one worker (see `MoerlWorker.moerl_routes_install`).

    Routes are kept by vLLM's internal request id: `<external>-<8 chars>`, and for sample i of
    an n-sample request `<i>_<external>-<8 chars>` (vLLM 0.32 `InputProcessor.assign_request_id`,
    `ParentRequest.get_child_info`); `take` finds a sample by its external id, index and n."""

    def __init__(self, layers: int, top_k: int) -> None:
        self.layers, self.top_k = layers, top_k
        self.routes: dict[str, np.ndarray] = {}  # internal id -> [positions, Y, K] int16, -1 none
        self.buf: np.ndarray | None = None
        self.rows = 0

    def on_route(self, layer: int, topk_ids) -> None:
        if self.buf is not None:
            self.buf[:, layer] = topk_ids[: self.rows].cpu().numpy()

    def record(self, rid: str, positions: np.ndarray, rows: np.ndarray) -> None:
        a = self.routes.get(rid)
        top = int(positions.max()) + 1
        if a is None or a.shape[0] < top:
            grown = np.full(
                (max(top, 2 * (0 if a is None else a.shape[0])), self.layers, self.top_k),
                -1,
                dtype=np.int16,
            )
            if a is not None:
                grown[: a.shape[0]] = a
            self.routes[rid] = a = grown
        a[positions] = rows

    @staticmethod
    def owner(rid: str) -> tuple[str, int | None]:
        """(external id, sample index or None for a single-sample request) of an internal id;
        the index prefix is ambiguous with an external id that starts with digits and `_`, which
        `take` resolves with the request's n."""
        base = rid.rsplit("-", 1)[0]
        head, sep, rest = base.partition("_")
        if sep and head.isdigit():
            return rest, int(head)
        return base, None

    def take(self, external: str, index: int, n: int) -> np.ndarray | None:
        want = f"{index}_{external}" if n > 1 else external
        for rid in list(self.routes):
            if rid.rsplit("-", 1)[0] == want:
                return self.routes.pop(rid)
        return None

    def forget(self, externals: set[str]) -> None:
        for rid in list(self.routes):
            base = rid.rsplit("-", 1)[0]
            ext, idx = self.owner(rid)
            if base in externals or (idx is not None and ext in externals):
                del self.routes[rid]


def node_copy(model_dir: str, expect_sha256: str | None = None) -> str:
    """Where this rank reads the version of a swap of an engine over several nodes
    (`hot_swap`'s `node_cache`). An absolute path is read as given. A relative one names the
    version under the node cache root, and each rank resolves it against its own node's root
    (MOERL_NODE_CACHE, set by the moerl process that started this rank): every node reads the
    copy it fetched and verified itself, and a node without that copy (or with another
    manifest's) fails the swap, naming itself."""
    import socket
    from pathlib import Path

    from moerl.components.rollout.group import ENV_NODE_CACHE
    from moerl.store.nodecache import MARKER

    if os.path.isabs(model_dir):
        return model_dir
    root = os.environ.get(ENV_NODE_CACHE)
    if not root:
        raise RuntimeError(
            f"swap to {model_dir}: a path under the node cache, but {ENV_NODE_CACHE} is unset "
            "on this engine rank"
        )
    path = Path(root) / model_dir
    marker = path / MARKER
    held = marker.read_text().split("\n")[0].strip() if marker.is_file() else None
    if held is None or (expect_sha256 is not None and held != expect_sha256):
        raise RuntimeError(
            f"node {socket.gethostname()}: {model_dir} is not in this node's verified cache {root} "
            f"(marker {held!r}, expected {expect_sha256!r})"
        )
    return str(path)


class MoerlWorker:
    """Mixed into vLLM's worker class on every rank (`self` is the worker)."""

    _moerl_capture: _Capture | None = None

    def moerl_rank(self) -> dict[str, int]:
        return _ranks(self)

    def moerl_param_digests(self) -> dict[str, str]:
        """Every parameter of this rank's model, by name: `param_digest`."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return {name: param_digest(p) for name, p in model.named_parameters()}

    def moerl_swap(
        self,
        model_dir: str,
        bucket_bytes: int,
        inplace: bool,
        version: int | None,
        fail_rank: int | None = None,
        expect_sha256: str | None = None,
        node_cache: bool = False,
    ) -> dict[str, Any]:
        """Load this rank's shard of `model_dir` (redistribute_weights/hotswap.py) and report the
        version it loaded and a digest over its parameters. `node_cache`: `model_dir` is a path
        under this node's cache (`node_copy`); else a folder read as given. `fail_rank`: fault
        injection for the tests (that rank raises before touching its weights)."""
        from moerl.components.redistribute_weights.hotswap import swap_in_worker

        ranks = _ranks(self)
        if fail_rank is not None and ranks["rank"] == fail_rank:
            raise RuntimeError(f"injected swap failure on rank {fail_rank}")
        if node_cache:
            model_dir = node_copy(model_dir, expect_sha256)
        stats = swap_in_worker(self, model_dir, bucket_bytes, inplace)
        digests = self.moerl_param_digests()
        h = hashlib.sha256()
        for name in sorted(digests):
            h.update(f"{name}={digests[name]};".encode())
        return {
            **stats,
            **ranks,
            "version": version,
            "digest": h.hexdigest(),
            "parameters": len(digests),
            "pid": os.getpid(),
        }

    def moerl_transfer_report(self, version: int) -> dict[str, Any]:
        """After a collective session (redistribute_weights/collective.py): what this rank
        received and loaded for `version`, and a digest over its parameters, as `moerl_swap`
        reports them; `version` None if this rank did not complete that version's session."""
        engine = getattr(self, "weight_transfer_engine", None)
        report = engine.report() if engine is not None and hasattr(engine, "report") else {}
        session = report.pop("session", None) or {}
        digests = self.moerl_param_digests()
        h = hashlib.sha256()
        for name in sorted(digests):
            h.update(f"{name}={digests[name]};".encode())
        return {
            "bytes": 0,
            "tensors": 0,
            "buckets": 0,
            "moe_layers_repacked": 0,
            "moe_layers_inplace": 0,
            "read_s": 0.0,
            "reload_s": 0.0,
            "repack_s": 0.0,
            **report,
            **_ranks(self),
            "version": session.get("version") if session.get("version") == version else None,
            "sha": session.get("sha"),
            "digest": h.hexdigest(),
            "parameters": len(digests),
            "pid": os.getpid(),
        }

    # -- route capture (rollout.return_routed_experts on CPU) --------------------------------
    def moerl_routes_install(self) -> dict[str, int]:
        """Hook every MoE layer's router and the runner's forward so each step's top-k expert ids
        land at their (request, position). Only rank 0 records; every rank checks its model."""
        from vllm.config import CompilationMode
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner  # type: ignore[attr-defined]
        if runner.vllm_config.compilation_config.mode != CompilationMode.NONE:
            raise RuntimeError(
                "route capture needs rollout.enforce_eager true: torch.compile traces the forward "
                "without the router's capture hook, which then never fires"
            )
        moe = [m for m in runner.model.modules() if isinstance(m, MoERunner)]
        if not moe:
            raise RuntimeError("rollout.return_routed_experts: the engine's model has no MoE layer")
        for m in moe:
            if m.routed_experts.quant_method.is_monolithic:
                raise RuntimeError(
                    f"route capture: the MoE kernel of layer {m.layer_id} is monolithic and routes "
                    "inside the kernel, without the capture hook; use the default CPU MoE kernel"
                )
        ids = sorted({int(m.layer_id) for m in moe})
        ordinal = {layer: i for i, layer in enumerate(ids)}
        top_k = int(runner.model_config.get_num_experts_per_tok())
        shape = {"layers": len(ids), "top_k": top_k, **_ranks(self)}
        if shape["rank"] != 0:
            return shape
        cap = self._moerl_capture = _Capture(len(ids), top_k)
        for m in moe:
            m.router.set_capture_fn(partial(cap.on_route, ordinal[int(m.layer_id)]))
        forward = runner._model_forward

        def model_forward(*args, **kw):
            nr = runner.input_batch.num_reqs
            if nr == 0 or "positions" not in kw:  # a dummy or profiling run
                return forward(*args, **kw)
            qsl = runner.query_start_loc.cpu[: nr + 1].numpy().copy()
            cap.rows = rows = int(qsl[-1])  # real rows; any padding after them is ignored
            cap.buf = np.full((rows, cap.layers, cap.top_k), -1, dtype=np.int16)
            try:
                out = forward(*args, **kw)
                buf = cap.buf
            finally:
                cap.buf = None
            positions = kw["positions"][:rows].cpu().numpy()
            for i, rid in enumerate(runner.input_batch.req_ids[:nr]):
                s, e = int(qsl[i]), int(qsl[i + 1])
                if e > s:
                    cap.record(rid, positions[s:e], buf[s:e])
            return out

        runner._model_forward = model_forward
        return shape

    def moerl_routes_take(self, wants: list[tuple[str, int, int]]) -> list[np.ndarray | None]:
        """The routes of each (external id, sample index, n), forgotten here; None where this
        rank does not record or never ran the sample."""
        cap = self._moerl_capture
        return [None if cap is None else cap.take(e, i, n) for e, i, n in wants]

    def moerl_routes_pending(self) -> int:
        """Requests whose routes this rank still holds (0 on a rank that does not record)."""
        return 0 if self._moerl_capture is None else len(self._moerl_capture.routes)

    def moerl_routes_forget(self, externals: list[str]) -> None:
        if self._moerl_capture is not None:
            self._moerl_capture.forget(set(externals))

    def moerl_routes_uninstall(self) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = self.model_runner  # type: ignore[attr-defined]
        runner.__dict__.pop("_model_forward", None)
        for m in runner.model.modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(None)
        self._moerl_capture = None


def _register_backend() -> None:
    """moerl's weight-transfer backend, registered with vLLM in every process that imports the
    worker extension (each engine rank does, before vLLM creates the backend at model load)."""
    from moerl.components.redistribute_weights.collective import register

    register()


_register_backend()
