#!/usr/bin/env bash
# The dispatch/combine benchmark on a GPU machine: all_to_all and hierarchical over NCCL, and
# deepep where the deep_ep package is installed (the moerl kernel image); written, not yet run.
#
# Usage (from the repository root, moerl installed):
#   kernels/gpu_bench.sh                      # one node, every visible GPU
#   NPROC_PER_NODE=8 NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 kernels/gpu_bench.sh   # on each node
#   kernels/gpu_bench.sh --repeats 50         # extra args go to `python -m benchmarks.dispatch`
#
# Configs, after DeepEP's tests: normal kernels at 4096 tokens/rank, hidden 7168, top-8,
# 256 experts (uniform and Zipf routing); low-latency at 128 tokens, 288 experts, forward only.
# hierarchical uses ranks_per_node = LOCAL_WORLD_SIZE (GPUs per node).
#
# Transport is NOT set here; export it before running. DeepEP V1 on AWS EFA (AWS's patched
# NVSHMEM): NVSHMEM_REMOTE_TRANSPORT=libfabric NVSHMEM_LIBFABRIC_PROVIDER=efa. On InfiniBand
# DeepEP uses IBGDA by default. NCCL_GIN_TYPE only matters to DeepEP V2 (not used here).
# Results: $OUT_DIR/bench_<config>_<nnodes>x<nproc>.json, plus the table on stdout.
set -euo pipefail

NPROC_PER_NODE=${NPROC_PER_NODE:-$(nvidia-smi -L | wc -l)}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29517}
OUT_DIR=${OUT_DIR:-bench-results}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT_DIR"

echo "# transport env (as found, not set by this script):"
env | grep -E '^(NVSHMEM_|NCCL_|FI_)' | sort || echo "#   (none)"
"$PYTHON" - <<'PY'
import torch
print(f"# torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
try:
    import deep_ep
    print(f"# deep_ep {getattr(deep_ep, '__version__', '?')}")
except Exception as exc:  # report and go on: deepep rows will say 'skipped'
    print(f"# deep_ep not importable: {exc}")
PY

run() {  # run <name> <bench args...>
  local name=$1; shift
  torchrun --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m benchmarks.dispatch --torchrun --out "$OUT_DIR/bench_${name}_${NNODES}x${NPROC_PER_NODE}.json" "$@"
}

run normal_uniform --tokens 4096 --hidden 7168 --topk 8 --experts 256 --skew uniform "${@}"
run normal_zipf    --tokens 4096 --hidden 7168 --topk 8 --experts 256 --skew zipf "${@}"
run low_latency    --tokens 128  --hidden 7168 --topk 8 --experts 288 --skew uniform --deepep-mode low_latency "${@}"
