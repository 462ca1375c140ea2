#!/usr/bin/env bash
# The prepared GPU check, for one machine with one or more CUDA GPUs and moerl installed
# (the trainer image, or a venv with the CUDA torch and vllm wheels):
#   bash tests/gpu/run.sh            # prints versions, runs tests/gpu, writes $OUT/gpu-check.txt
#   GPU_TESTS=tests/gpu/test_rollout_layouts.py bash tests/gpu/run.sh   # the rollout engines only
#   GPU_TESTS=tests/gpu/test_wide_ep.py bash tests/gpu/run.sh          # the DP x EP engine over every GPU
#   GPU_TESTS=tests/gpu/test_fp8_serving.py bash tests/gpu/run.sh      # FP8 serving (one GPU)
# On a lent device (15 minutes): tests/gpu/ladder.sh, the checks as rungs in order, each timed out, stopping at the first failure.
# It checks the CUDA trainer against the CPU trainer, the sharded (FSDP2 + EP) worker over NCCL
# (one rank; and with bf16 mixed precision and activation checkpointing: its peak memory
# against the static formula, tokens/s), and a CUDA vLLM engine hot-swapped to a new version
# against a fresh load (by name on every rank, CUDA graphs on), bf16 serving (rollout.dtype)
# against a float32 engine and transformers, its routed experts (enable_return_routed_experts)
# against the trainer's routers, FP8 serving (rollout.quantization fp8: a tiny MoE engine
# hot-swapped twice, its logprobs against bf16 engines on the same weights;
# tests/gpu/test_fp8_serving.py), and with 2+ GPUs TP = 2 and DP 2 x EP 2 over
# allgather_reducescatter and deepep_v2 (skipped on one GPU, each with its reason), a DP x EP
# engine over every GPU here
# (data_parallel_size = the GPU count) with each backend and the transport it records
# (tests/gpu/test_wide_ep.py: rollout.transport.* says the backend, EP size, nvlink-only); then
# the async trainer's persistent mesh on NCCL (one rank per GPU: versions kept in memory against
# versions reloaded from files, and the time of each); the dispatch benchmark over NCCL with `kernels/gpu_bench.sh` when GPU_BENCH=1; and, when
# GPU_ROLLOUT=1, `moerl bench rollout` on the GPU: the long-tail workload with a version every
# second (between-units drains against in-flight updates, where a decode step costs about the
# same at any batch, with `--breakdown`: where the worker's time goes on a GPU engine) and a
# rollout.max_num_seqs sweep (the GPU profile's default, issue 24); and, when GPU_LAYOUTS=1 on
# 2+ GPUs, `moerl bench rollout --tensor-parallel 1,2` and `--all2all allgather_reducescatter,deepep_v2`.
# Written for a lent GPU; not yet run (no GPU was available to the session that wrote it).
set -euo pipefail
OUT=${OUT:-gpu-check}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvidia-smi topo -m || true
  "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
    || echo "torch: no CUDA build (NCCL version unknown)"
  "$PYTHON" -c "import vllm; print('vllm', vllm.__version__)" || echo "vllm: not importable"
  "$PYTHON" -c "import deep_ep; print('deep_ep', getattr(deep_ep, '__version__', '?'))" || echo "deep_ep: not importable"
} | tee "$OUT/versions.txt"
"$PYTHON" -m pytest "${GPU_TESTS:-tests/gpu}" -v -s -rsx -p no:cacheprovider --noconftest -p tests.support.gloo_world 2>&1 | tee "$OUT/gpu-check.txt"
if [ "${GPU_BENCH:-0}" = 1 ]; then
  OUT_DIR="$OUT" bash kernels/gpu_bench.sh --repeats 20 2>&1 | tee "$OUT/dispatch.txt"
fi
if [ "${GPU_ROLLOUT:-0}" = 1 ]; then
  GPU_SET=(--set rollout.device=cuda --set model.dtype=bfloat16 --set rollout.engine_in_process=false
           --set rollout.gpu_memory_utilization=0.8)
  "$PYTHON" -m moerl.cli bench rollout configs/tiny-moe-grpo.yaml "${GPU_SET[@]}" --workload long-tail --units 16 \
    --in-flight 4 --updates between_units,in_flight --swap-every 1 --breakdown --out "$OUT/rollout-long-tail.json" \
    2>&1 | tee "$OUT/rollout-long-tail.txt"
  "$PYTHON" -m moerl.cli bench rollout configs/tiny-moe-grpo.yaml "${GPU_SET[@]}" --workload long-tail --units 16 \
    --in-flight 4 --max-num-seqs 64,256,1024 --out "$OUT/rollout-max-num-seqs.json" 2>&1 | tee "$OUT/rollout-max-num-seqs.txt"
fi
if [ "${GPU_LAYOUTS:-0}" = 1 ]; then
  # `moerl bench rollout` layout comparisons (issue 37): TP 1 against TP 2, then at TP 2 with
  # expert parallelism allgather_reducescatter against deepep_v2; a variant that fails is in
  # the report (and the table) with its error, so the script goes on
  GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  if [ "${GPUS:-0}" -ge 2 ]; then
    LAYOUT_SET=(--set rollout.device=cuda --set rollout.engine_in_process=false --set units.max_prompts=16
                --set model.tiny.max_position_embeddings=256 --set rollout.max_new_tokens=128)
    "$PYTHON" -m moerl.cli bench rollout configs/tiny-moe-grpo.yaml "${LAYOUT_SET[@]}" --tensor-parallel 1,2 \
      --units 4 --repeats 2 --timeout 600 --out "$OUT/layouts-tp.json" 2>&1 | tee "$OUT/layouts-tp.txt" || true
    "$PYTHON" -m moerl.cli bench rollout configs/tiny-moe-grpo.yaml "${LAYOUT_SET[@]}" \
      --set rollout.tensor_parallel_size=2 --all2all allgather_reducescatter,deepep_v2 --units 4 --repeats 2 \
      --timeout 600 --out "$OUT/layouts-all2all.json" 2>&1 | tee "$OUT/layouts-all2all.txt" || true
  else
    echo "GPU_LAYOUTS: the layout comparisons need 2 GPUs; this machine has ${GPUS:-0}" | tee "$OUT/layouts.txt"
  fi
fi
