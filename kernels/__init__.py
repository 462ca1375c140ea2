"""Expert-parallel dispatch/combine backends behind one `Dispatcher` interface.

    from moerl.kernels import make_dispatcher
    d = make_dispatcher("all_to_all", num_experts=E, group=ep_group)    # on every EP rank
    recv_x_RH, tokens_per_local_expert_L, handle = d.dispatch(x_TH, topk_idx_TK, topk_weights_TK)
    y_RH = run_local_experts(recv_x_RH, tokens_per_local_expert_L)        # rows grouped by local expert
    out_TH = d.combine(y_RH, handle)                                      # routing weights applied here

Backends: local (no communication), all_to_all (baseline), hierarchical (node-deduplicated),
deepep (DeepEP V1 Buffer, GPU only). See docs/architecture.md, "Checkpoints and expert parallelism", and
the module docstrings for each backend's limitations.
"""

from moerl.kernels.dispatcher import (
    BACKENDS,
    Dispatcher,
    DispatchHandle,
    make_dispatcher,
    routing_bytes,
)

__all__ = ["BACKENDS", "DispatchHandle", "Dispatcher", "make_dispatcher", "routing_bytes"]
