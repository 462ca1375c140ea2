"""A local async run whose stages are forked from one zygote (`pipeline.fork_stages`, as
`moerl run` starts them), nightly tier: each stage process is named for its stage in ps and top,
and a SIGTERM to the zygote mid-run drains every stage as a node's kubelet would (a rollout
worker and a scorer exit 75, drained), instead of killing them all with it (-9); the run
restarts them anew, said, and completes every version with its counters balanced.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from moerl.components.rollout.worker import EXIT_DRAINED
from tests.support.fault_runs import Harness, balanced, versions_of

pytestmark = pytest.mark.nightly


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()


def test_a_sigterm_to_the_zygote_drains_the_stages_and_the_run_completes(tmp_path):
    h = Harness(tmp_path, "pipeline.versions=5", zygote=True)
    state: dict = {}

    def fault(run) -> None:
        reg = run.bus.registry()
        if "sent" in state or reg is None or reg.version < 2:
            return
        zygote = run.zygotes["stages"]
        state["titles"] = {n: _cmdline(c.proc.pid) for n, c in run.children.items()}
        state["zygote"] = _cmdline(zygote.proc.pid)
        state["sent"] = reg.version
        os.kill(zygote.proc.pid, signal.SIGTERM)

    c = h.go(fault)
    assert "sent" in state
    assert state["zygote"] == "moerl: zygote"
    assert state["titles"] == {n: f"moerl: {n}" for n in state["titles"]}
    first = {n: ch.exits[0] for n, ch in h.run.children.items() if ch.exits}
    assert first["rollout-0"] == EXIT_DRAINED and first["scorer-0"] == EXIT_DRAINED, first
    assert -signal.SIGKILL not in first.values(), first  # nothing died with the zygote
    assert h.run.fallbacks  # the later stages started anew, and said so
    assert versions_of(h)[-1] == h.cfg.pipeline.versions
    balanced(c, h.cfg)
