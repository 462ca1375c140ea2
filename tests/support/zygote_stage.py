"""A stage module for tests/launch/test_zygote*.py: records what a forked process sees, then
exits with the code it is given (or sleeps, or raises; `drain`: sleeps until a SIGTERM, which it
marks; `stubborn`: sleeps, ignoring SIGTERM)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out, code = args[0], int(args[1])
    mode = args[2] if len(args) > 2 else ""
    print(f"stage says hello to {out}", flush=True)
    info = {
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "argv": sys.argv,
        "env": {k: v for k, v in os.environ.items() if k.startswith("ZYGOTE_TEST_")},
        "cpus": sorted(os.sched_getaffinity(0)),
        "random": random.random(),
        "preloaded": "tests.support.zygote_preload" in sys.modules,
    }
    if mode == "drain":  # a SIGTERM drains it: a marker, then exit 0 (as a rollout worker's)
        signal.signal(signal.SIGTERM, lambda *_: (open(out + ".drained", "w").close(), sys.exit(0)))
    if mode == "stubborn":  # ignores SIGTERM: only SIGKILL ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(out, "w") as f:
        json.dump(info, f)
    if mode in ("sleep", "drain", "stubborn"):
        time.sleep(600)
    if mode == "raise":
        raise RuntimeError("the stage broke on purpose")
    return code


if __name__ == "__main__":
    sys.exit(main())
