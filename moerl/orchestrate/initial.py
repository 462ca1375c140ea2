"""Version 0 of a local async run, published by a process of its own (as init_policy's task).

Design, details and limitations: docs/pipelines.md#moerlorchestrateasync_runpy.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

from moerl.config import RunConfig, config_from_json
from moerl.errors import MoerlError


def publish_initial(cfg: RunConfig, run_id: str, work: Path) -> None:
    """Version 0, as the pipeline's init_policy task publishes it."""
    from moerl.components.publish_checkpoint import stage

    state = work / "init-state"
    stage.publish_initial(cfg, run_id, state)
    shutil.rmtree(state, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m moerl.orchestrate.initial --config C --run-id R --work W`."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--work", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s init_policy %(levelname)s %(message)s"
    )
    text = Path(a.config).read_text()
    cfg = config_from_json(text)
    from moerl.launch.podenv import enter_pod

    enter_pod("init_policy", text)  # as the component does (and it logs when it entered)
    try:
        publish_initial(cfg, a.run_id, Path(a.work))
    except MoerlError as err:
        logging.getLogger(__name__).error("%s", err)
        return err.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
