"""A stage module for tests/launch/test_zygote.py: records what a forked process sees, then
exits with the code it is given (or sleeps, or raises)."""

from __future__ import annotations

import json
import os
import random
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
    with open(out, "w") as f:
        json.dump(info, f)
    if mode == "sleep":
        time.sleep(600)
    if mode == "raise":
        raise RuntimeError("the stage broke on purpose")
    return code


if __name__ == "__main__":
    sys.exit(main())
