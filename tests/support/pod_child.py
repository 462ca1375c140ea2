"""A stand-in rollout worker for tests/rollout/test_rollout_pod.py: records its
name and devices in $POD_CHILD_OUT/<name>.json, then exits with its code from $POD_CHILD_CODES
(name=code, comma-separated), or, without one, waits for SIGTERM and exits 75 (a drain)."""

import argparse
import json
import os
import signal
import sys
import time

ap = argparse.ArgumentParser()
for flag in ("--config", "--run-id", "--name"):
    ap.add_argument(flag, required=True)
a = ap.parse_args()
out = os.path.join(os.environ["POD_CHILD_OUT"], a.name + ".json")
record = {"devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "config": os.path.isfile(a.config)}
codes = dict(kv.split("=") for kv in os.environ.get("POD_CHILD_CODES", "").split(",") if kv)


def _drain(signum, frame):
    with open(out, "w") as f:
        json.dump({**record, "drained": True}, f)
    sys.exit(75)


signal.signal(signal.SIGTERM, _drain)
with open(out, "w") as f:
    json.dump(record, f)
if a.name in codes:
    if int(codes[a.name]):  # a crash: once every sibling is up (its SIGTERM handler set)
        deadline = time.monotonic() + 20
        while len(os.listdir(os.environ["POD_CHILD_OUT"])) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    sys.exit(int(codes[a.name]))
time.sleep(60)
sys.exit(3)
