"""One reader of `moerl bench weights`' fan-out measurement: a process standing in for a rollout
node. It serves chunks (with `--fanout`), says `ready`, waits for the start file, fetches the
version into its own node cache through the tiers (with the fan-out, or from the cache tier
alone), prints one JSON line (seconds, source, chunk counts) and keeps serving until the stop
file appears, so slower peers can still pull from it.

    python -m benchmarks.fanreader --config CK.json --run-id R --bus-run B --version V --name N
        --cache DIR --valkey URL --start FILE --stop FILE [--fanout]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    for flag in (
        "--config",
        "--run-id",
        "--bus-run",
        "--name",
        "--cache",
        "--valkey",
        "--start",
        "--stop",
    ):
        ap.add_argument(flag, required=True)
    ap.add_argument("--version", type=int, required=True)
    ap.add_argument("--fanout", action="store_true")
    a = ap.parse_args(argv)
    from moerl.bus import RunBus, connect
    from moerl.config import CheckpointConfig
    from moerl.store.fanout import Swarm
    from moerl.store.runs import ENGINE_EXCLUDE
    from moerl.store.tiers import run_tiers

    cfg = CheckpointConfig.model_validate_json(Path(a.config).read_text())
    tiers = run_tiers(cfg, a.run_id)
    swarm = None
    if a.fanout:
        swarm = Swarm(RunBus(connect(a.valkey, 10.0), a.bus_run), a.name, cfg)
        swarm.serve()
    print("ready", flush=True)
    while not Path(a.start).exists():
        time.sleep(0.01)
    t0 = time.perf_counter()
    _, source = tiers.fetch(a.version, Path(a.cache), ENGINE_EXCLUDE, swarm=swarm)
    seconds = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "name": a.name,
                "seconds": seconds,
                "source": source,
                "chunks": dict(swarm.counts) if swarm else {},
            }
        ),
        flush=True,
    )
    while swarm is not None and not Path(a.stop).exists():
        time.sleep(0.05)
    if swarm is not None:
        swarm.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
