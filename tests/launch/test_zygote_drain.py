"""The zygote's stages on one machine (moerl/launch/zygote.py): each process named for its stage
in ps and top (`moerl: rollout-0`, the zygote `moerl: zygote`), and a SIGTERM to the zygote
drains its stages as a pod's kubelet would (SIGTERM to each, a bounded grace, then SIGKILL),
instead of killing them all with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from moerl.launch import procs
from moerl.launch.zygote import GRACE_ENV, Zygote

STAGE = "tests.support.zygote_stage"
GRACE_S = 3.0


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != procs.TITLE_ENV}, **extra}


def _title(pid: int) -> tuple[str, str]:
    """What ps shows (the command line) and what top shows (the kernel's name)."""
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
    return cmd, Path(f"/proc/{pid}/comm").read_text().strip()


def test_stages_are_named_and_a_sigterm_to_the_zygote_drains_them(tmp_path):
    z = Zygote("stages", [STAGE], {**os.environ, GRACE_ENV: str(GRACE_S)}, tmp_path / "zygote.log")
    try:
        z.ready()
        runs = {
            "rollout-0": ("drain", {procs.TITLE_ENV: "rollout-0"}),
            "trainer": ("drain", {}),  # no title given: named after its log
            "scorer-0": ("stubborn", {procs.TITLE_ENV: "scorer-0"}),
        }
        out = {n: str(tmp_path / f"{n}.json") for n in runs}
        kids = {
            n: z.spawn(STAGE, [out[n], "0", mode], _env(**env), tmp_path / f"{n}.log")
            for n, (mode, env) in runs.items()
        }
        deadline = time.monotonic() + 30
        while not all(os.path.exists(f) for f in out.values()):
            assert time.monotonic() < deadline, "the stages did not start"
            time.sleep(0.05)
        assert _title(z.proc.pid) == ("moerl: zygote", "moerl: zygote")
        for name, p in kids.items():
            assert _title(p.pid) == (f"moerl: {name}", f"moerl: {name}"[:15])
        t0 = time.monotonic()
        os.kill(z.proc.pid, signal.SIGTERM)
        # drained: each ran its SIGTERM handler and exited 0, not -9 with the zygote
        assert kids["rollout-0"].wait(timeout=30) == 0
        assert kids["trainer"].wait(timeout=30) == 0
        assert all(os.path.exists(out[n] + ".drained") for n in ("rollout-0", "trainer"))
        # one that ignores SIGTERM is killed once the grace is over, and the zygote exits
        assert kids["scorer-0"].wait(timeout=30) == -signal.SIGKILL
        assert z.proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert GRACE_S <= time.monotonic() - t0 < GRACE_S + 15
        log = (tmp_path / "zygote.log").read_text()
        assert "draining 3 stages" in log and "still ran after 3 s: SIGKILL" in log
    finally:
        z.close()


def test_without_setproctitle_the_name_top_shows_is_set_by_prctl():
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['setproctitle'] = None\n"
        "from pathlib import Path\n"
        "from moerl.launch.procs import set_title\n"
        "print(set_title('rollout-3'), Path('/proc/self/comm').read_text().strip())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().split(None, 1) == ["prctl", "moerl: rollout-"], out.stderr
