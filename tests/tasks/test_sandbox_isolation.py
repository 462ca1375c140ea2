"""Sandboxed code against the stage that runs it (moerl/tasks/isolation.py):
a hostile verifier and model-written code in a hostile environment try to read the stage's
environment and memory out of /proc, connect to a listening TCP server and to a real Valkey on
127.0.0.1, and write into a directory standing for the node cache. Every process is real: a
stage process (with a secret in its environment from exec, as a pod's would be) runs the reward
stage's `score` and the rollout's `EpisodeDriver` on their own pools. With isolation `none`
the same attacks succeed (so each assertion could fail); with `namespaces` each one fails,
its sample or episode is failed and counted, and the next call works."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from moerl.bus.client import EmbeddedValkey
from moerl.tasks import isolation
from moerl.tasks.sandbox import Limits, SandboxPool

ROOT = Path(__file__).resolve().parents[2]
SECRET = "VALKEY_PASSWORD=hunter2-not-for-sandboxes"
ATTACKS = (
    "environ {stage} " + SECRET,
    "mem {stage}",
    "environ ppid " + SECRET,
    "environ {victim} VICTIM=stolen",
    "connect 127.0.0.1:{listener}",
    "connect 127.0.0.1:{valkey}",
    "unix {unix}",
    "write {cache}",
    "write {usercode}",
)
WORKS = ("import sbx_usercode",)  # not attacks: the stage's import path, also under its temp dir

STAGE = textwrap.dedent("""
    import json, os, sys
    from moerl.errors import MoerlError
    from moerl.tasks import isolation
    from moerl.tasks.sandbox import SandboxError
    iso, spec = sys.argv[1], json.loads(sys.argv[2])
    attacks = [a.format(stage=os.getpid(), **spec) for a in spec["attacks"] + spec["works"]]
    out = {"dumpable_before": isolation.dumpable()}
    from moerl.components.reward.stage import reward_metrics, score
    from moerl.config import RewardConfig
    from moerl.records import Sample
    def sample(i, text):
        return Sample(prompt_id="p0", task="copy", prompt="copy 456=", answer="456", sample_index=i,
                      prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[-0.5],
                      response_text=text, finish_reason="stop", policy_version=0)
    cfg = RewardConfig(verifier="tests.support.hostile_verifiers:attacks", max_failed_fraction=1.0,
                       sandbox={"sample_timeout_s": 20.0, "workers": 1, "isolation": iso})
    try:
        scored = score([sample(i, t) for i, t in enumerate(attacks + ["456"])], cfg)
    except (MoerlError, SandboxError) as err:
        print(json.dumps({"refused": f"{type(err).__name__}: {err}"}))
        sys.exit(0)
    out["verifier"] = [[s.reward, s.reward_error] for s in scored]
    out["reward_metrics"] = reward_metrics(scored)
    out["dumpable_after"] = isolation.dumpable()
    if spec.get("environments"):
        from moerl.components.rollout.engine import Completion
        from moerl.components.rollout.episodes import EpisodeDriver, env_pool
        from moerl.config import load_config
        from moerl.models.tiny import build_tokenizer
        run = load_config(os.path.join("configs", "tiny-moe-grpo.yaml"),
                          ["task.environment=tests.support.hostile_environments:RunsModelCode",
                           f"task.sandbox.isolation={iso}", "task.sandbox.sample_timeout_s=20"])
        codes = [f"from tests.support.hostile_verifiers import attack; result = attack({a.split(' ', 1)[0]!r}, "
                 f"{a.split(' ', 1)[1]!r})" for a in attacks] + ["result = 6 * 7"]
        with env_pool(run) as pool:
            d = EpisodeDriver(run, build_tokenizer(), pool)
            eps = [d.episode(f"e{i}", {"id": f"r{i}", "task": "copy", "prompt": "q", "answer": "a", "meta": None},
                             [7, 8], 0, False) for i in range(len(codes))]
            d.begin(eps)
            d.advance([(e, Completion([5], [-1.0], code, "stop")) for e, code in zip(eps, codes)])
            d.finish(eps)
            out["episodes"] = [[e.error, e.sample(0).env_reward] for e in eps]
            out["env_metrics"] = d.metrics(eps, 1.0)
    print(json.dumps(out))
""")


class Listener:
    """A TCP server on 127.0.0.1 (or a unix socket at `path`) that answers +PONG and counts the
    connections it accepted."""

    def __init__(self, path: str | None = None):
        if path:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind(path)
            self.sock.listen()
        else:
            self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1] if not path else 0, 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                conn.recv(64)
                conn.sendall(b"+PONG\r\n")

    def close(self):
        try:  # wakes the accept() blocked in the thread (close alone does not, on Linux)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """What the attacks aim at: a listener, a real Valkey (default user, no password: the
    loopback admin), a dumpable process with a secret in its environment, and a cache dir."""
    listener = Listener()
    victim = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        env={"PATH": os.environ["PATH"], "VICTIM": "stolen"},
    )
    try:
        with EmbeddedValkey(tmp_path_factory.mktemp("valkey"), appendonly=False) as valkey:
            yield {"listener": listener, "valkey": valkey, "victim": victim.pid}
    finally:
        victim.kill()
        victim.wait()
        listener.close()


@pytest.fixture
def pod(tmp_path):
    """What a stage's pod holds beside the targets: its temp dir (TMPDIR, where the sandbox's
    scratch directories go) with a unix socket listening in it (standing for vLLM's ipc
    sockets) and user code on the import path under it, and a node cache outside it."""
    tmp, cache = tmp_path / "t", tmp_path / "node-cache"
    (tmp / "usercode").mkdir(parents=True)
    (tmp / "usercode" / "sbx_usercode.py").write_text("VALUE = 1\n")
    cache.mkdir()
    unix = Listener(str(tmp / "ipc"))
    try:
        yield {"tmp": tmp, "cache": cache, "usercode": tmp / "usercode", "unix": unix}
    finally:
        unix.close()


def _stage(isolation_: str, spec: dict, pod: dict, wrap: list[str] | None = None) -> dict:
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": f"{ROOT}{os.pathsep}{pod['usercode']}",
        "LANG": "C.UTF-8",
        "TMPDIR": str(pod["tmp"]),
        SECRET.split("=")[0]: SECRET.split("=")[1],
    }
    got = subprocess.run(
        [*(wrap or []), sys.executable, "-c", STAGE, isolation_, json.dumps(spec)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return {**json.loads(got.stdout.strip().splitlines()[-1]), "stderr": got.stderr}


def _spec(targets, pod, environments: bool = True) -> dict:
    return {
        "attacks": list(ATTACKS),
        "works": list(WORKS),
        "listener": targets["listener"].port,
        "victim": targets["victim"],
        "valkey": targets["valkey"].url.rsplit(":", 1)[1].split("/")[0],
        "unix": str(pod["tmp"] / "ipc"),
        "cache": str(pod["cache"]),
        "usercode": str(pod["usercode"]),
        "environments": environments,
    }


def test_without_isolation_every_attack_but_the_non_dumpable_stage_succeeds(targets, pod):
    """The control: the attacks work, so the isolated run below could fail."""
    before = targets["listener"].accepted
    out = _stage("none", _spec(targets, pod), pod)
    assert "WARNING: reward.sandbox.isolation / task.sandbox.isolation is none" in out["stderr"]
    assert out["dumpable_before"] is True and out["dumpable_after"] is False
    stolen = [r == 1.0 and not err for r, err in out["verifier"]]
    # a root stage's unisolated children hold CAP_SYS_PTRACE: non-dumpable is no protection there
    assert stolen[:2] == [os.geteuid() == 0] * 2, out["verifier"]
    # a call's parent is the pool's template, whose environment is the allow-list's
    assert "is not in the" in out["verifier"][2][1], out["verifier"]
    # the victim, the three sockets, both directories; the import; the benign sample
    assert stolen[3:] == [True] * (len(ATTACKS) - 3 + len(WORKS) + 1), out["verifier"]
    # model-written code in an environment
    env_stolen = [reward == 1.0 and not err for err, reward in out["episodes"]]
    assert env_stolen == stolen, out["episodes"]
    assert targets["listener"].accepted == before + 2 and pod["unix"].accepted == 2
    assert (pod["cache"] / "forged-by-sandbox").read_text() == (
        pod["usercode"] / "forged-by-sandbox"
    ).read_text()


def test_isolated_verifiers_and_environments_fail_every_attack_and_the_run_goes_on(targets, pod):
    before = targets["listener"].accepted
    out = _stage("namespaces", _spec(targets, pod), pod)
    assert out["dumpable_before"] is True and out["dumpable_after"] is False
    n = len(ATTACKS)
    failed = out["verifier"][:n]
    assert all(r == 0.0 and err for r, err in failed), failed
    errs = [err for _, err in failed]
    # no such pid here
    assert errs[0].startswith("FileNotFoundError") and errs[1].startswith("FileNotFoundError")
    # the parent it has is pid 1 of its namespace, non-dumpable
    assert errs[2].startswith("PermissionError")
    # the dumpable victim is outside its pid namespace
    assert errs[3].startswith("FileNotFoundError")
    assert all(e.startswith("OSError: [Errno 101] Network is unreachable") for e in errs[4:6]), errs
    # the stage's temp dir is hidden, its socket with it
    assert errs[6].startswith("FileNotFoundError"), errs
    assert all(e.startswith("OSError: [Errno 30] Read-only file system") for e in errs[7:9]), errs
    # user code imports; the run goes on
    assert out["verifier"][n:] == [[1.0, None]] * (len(WORKS) + 1)
    m = out["reward_metrics"]
    assert (m["reward/failed_samples"], m["reward/error_samples"], m["reward/timeout_samples"]) == (
        n,
        n,
        0,
    ), m
    eps = out["episodes"]
    assert all(err and "RunsModelCode.step" in err and reward is None for err, reward in eps[:n]), (
        eps
    )
    assert [e.split(": ")[1] for e, _ in eps[:n]] == [e.split(":")[0] for e in errs], eps
    assert eps[n:] == [[None, 1.0]] * (len(WORKS) + 1)
    assert (
        out["env_metrics"]["env/error_episodes"] == n
        and out["env_metrics"]["env/timeout_episodes"] == 0
    )
    assert targets["listener"].accepted == before and pod["unix"].accepted == 0
    assert not list(pod["cache"].iterdir()) and not (pod["usercode"] / "forged-by-sandbox").exists()


def test_a_kernel_that_refuses_user_namespaces_stops_the_stage_naming_the_field(targets, pod):
    """A real refusal: the stage runs in a user namespace whose user.max_user_namespaces is 0
    (what a locked-down node sysctl does); `none` there runs, warned."""
    wrap = [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "sh",
        "-c",
        'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
        "sh",
    ]
    out = _stage("namespaces", _spec(targets, pod, environments=False), pod, wrap)
    assert out["refused"].startswith(
        "ConfigError: reward.sandbox.isolation / task.sandbox.isolation: namespaces "
        "cannot be made here (unshare exited 1: unshare: unshare failed"
    ), out
    assert "set the field to none" in out["refused"]
    out = _stage(
        "none", {**_spec(targets, pod, environments=False), "attacks": [], "works": []}, pod, wrap
    )
    assert out["verifier"] == [[1.0, None]] and "is none" in out["stderr"]


# A user namespace mapping uid/gid 0 and 65534 (a root stage's sandbox maps its calls' real
# uid to 65534, for their pids limit), then the command: what `unshare --map-users` does with
# newuidmap, which this machine lacks.
_TWO_UIDS_CODE = """
import ctypes, os, sys, time
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(go_w)
    if ctypes.CDLL(None).unshare(0x10000000 | 0x20000) != 0:
        os._exit(99)
    os.read(go_r, 1)
    os.execvp(sys.argv[1], sys.argv[1:])
os.close(go_r)
while os.readlink(f"/proc/{pid}/ns/user") == os.readlink("/proc/self/ns/user"):
    time.sleep(0.001)
for m in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{m}", "w") as f:
        f.write("0 0 1\\n65534 65534 1\\n")
os.write(go_w, b"g")
os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
_TWO_UIDS = [sys.executable, "-c", _TWO_UIDS_CODE]


def test_where_the_runtime_masks_proc_the_sandbox_refuses_to_start_naming_why(targets, pod):
    """A container runtime's default masks parts of /proc (Docker, containerd): the kernel then
    refuses a new proc mount in a user namespace, and without one the sandbox cannot map its
    calls' user namespaces. Made real here: the stage runs where /proc/sys is overmounted, as
    there; the pool refuses, naming why, and no attack runs."""
    wrap = [
        *_TWO_UIDS,
        "unshare",
        "--mount",
        "--pid",
        "--fork",
        "--mount-proc",
        "sh",
        "-c",
        'mount -t tmpfs masked /proc/sys && exec "$@"',
        "sh",
    ]
    before = targets["listener"].accepted
    spec = _spec(targets, pod, environments=False)
    out = _stage("namespaces", spec, pod, wrap)
    assert "the runtime masks /proc" in out["refused"] and "procMount: Unmasked" in out["refused"]
    assert out["refused"].startswith("SandboxError: reward.sandbox.isolation"), out
    assert targets["listener"].accepted == before and not list(pod["cache"].iterdir())


def test_isolated_children_keep_the_limits_and_keyed_calls_and_drop_their_capabilities(tmp_path):
    from moerl.tasks.environments import RESET, STEP

    with SandboxPool(Limits(timeout_s=5.0, memory_mb=512, workers=2)) as pool:
        assert pool.limits.isolation == "namespaces"
        got = pool.run(
            [
                ("tests.support.hostile_verifiers:sleeps", ["", ""]),
                ("tests.support.hostile_verifiers:allocates", ["", ""]),
                ("tests.support.hostile_verifiers:capabilities", ["", ""]),
            ]
        )
        assert [o.kind for o in got] == ["timeout", "memory", "ok"], got
        caps = got[2].value
        assert (
            caps["CapEff"] == caps["CapPrm"] == caps["CapBnd"] == 0 and caps["NoNewPrivs"] == 1
        ), caps
        assert (
            caps["pid"] == 2
            and caps["ppid"] == 1
            and caps["CapAmb"] == 0
            and caps["proc"] == "proc"
        ), caps
        cmd = Path(f"/proc/{pool.template.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert Path(cmd[0].decode()).name == "unshare" and b"--net" in cmd and b"--user" in cmd, cmd
        keys = ["k", "k", "k"]
        steps = pool.run(
            [
                (
                    RESET,
                    [
                        "tests.support.hostile_environments:Counter",
                        "k",
                        {"id": "r", "task": "t", "prompt": "q", "answer": "a", "meta": None},
                    ],
                ),
                (STEP, ["k", "x"]),
                (STEP, ["k", "x"]),
            ],
            keys=keys,
        )
        assert [s.value[0].split("@")[0] for s in steps[1:]] == ["1", "2"], steps


def test_a_bad_isolation_is_refused_naming_the_field():
    from moerl.errors import ConfigError

    with pytest.raises(
        ConfigError,
        match=r"reward.sandbox.isolation / task.sandbox.isolation: 'bwrap' is not one "
        r"of namespaces, none",
    ):
        SandboxPool(Limits(isolation="bwrap"))
    assert isolation.tags("none", "namespaces") == {
        "moerl.sandbox.isolation.reward": "none",
        "moerl.sandbox.isolation.task": "namespaces",
        "moerl.sandbox.limits.reward": isolation.LIMITS["none"],
        "moerl.sandbox.limits.task": isolation.LIMITS["namespaces"],
    }


def test_a_run_carries_its_sandboxes_isolation_as_tags_and_params(tmp_path):
    """`none` is never silent: the MLflow run says it (tags and the resolved config's params)."""
    from mlflow.tracking import MlflowClient

    from moerl import tracking
    from moerl.config import parse_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = parse_config(
        {
            "tracking": {"uri": uri, "experiment": "iso"},
            "checkpoint": {"uri": str(tmp_path / "ck")},
            "task": {"sandbox": {"isolation": "none"}},
        }
    )
    run = MlflowClient(uri).get_run(tracking.start_run(cfg, uri, {}))
    assert run.data.tags["moerl.sandbox.isolation.task"] == "none"
    assert run.data.tags["moerl.sandbox.isolation.reward"] == "namespaces"
    assert "seccomp" in run.data.tags["moerl.sandbox.limits.reward"]
    assert run.data.params["task.sandbox.isolation"] == "none"


def _descendants(pid: int) -> set[int]:
    parents = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parents[int(d)] = int(
                    Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                pass
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parents.items() if pp == p} - found
        found |= kids
        todo.extend(kids)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_every_process_of_an_isolated_child_goes_when_its_stage_is_killed(tmp_path):
    """unshare, pid 1 of the namespace and the process running a hung call: the last sees the
    stage's end of its pipe close (its parent pid says nothing inside a pid namespace)."""
    import signal
    import time

    script = tmp_path / "stage.py"
    script.write_text(
        textwrap.dedent("""
        import threading, time
        from moerl.tasks.sandbox import SandboxPool, Limits
        pool = SandboxPool(Limits(timeout_s=600))
        threading.Thread(target=lambda: pool.run([("tests.support.hostile_verifiers:sleeps", ["", ""])]), daemon=True).start()
        while not pool.template: time.sleep(0.05)
        time.sleep(1)  # the call's processes forked
        print(pool.template.proc.pid, flush=True)
        time.sleep(600)
    """)
    )
    stage = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    procs: set[int] = set()
    try:
        unshare = int(stage.stdout.readline())
        deadline = time.monotonic() + 30
        while len(procs := {unshare} | _descendants(unshare)) < 9 and time.monotonic() < deadline:
            time.sleep(0.1)
        # unshare, pid 1 of the namespace, the template; the call's: its waiter, its pid 1,
        # itself; and the same three set up ahead for the next call
        assert len(procs) == 9, procs
        os.kill(stage.pid, signal.SIGKILL)
        stage.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in procs if _alive(p)]
    finally:
        stage.kill()
        stage.wait()
        for p in procs:  # what this test started, should the assertion have failed
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def test_a_checkout_and_venv_under_the_stages_temp_dir_stay_importable(tmp_path):
    """The child hides the stage's temp directory. A checkout with its venv under it (a CI
    clone in /tmp; moerl installed editable, mapped by a finder, not on sys.path) must stay
    importable: `moerl run` failed its preflight there, every environment refused with
    "No module named 'moerl.tasks.environments'". Here the stage's TMPDIR is the checkout's
    parent, and nothing is on PYTHONPATH."""
    if ROOT.parent == Path("/"):
        pytest.skip("the checkout's parent is /: no temp directory can hold it")
    code = (
        "import json; from moerl.tasks.sandbox import Limits, SandboxPool\n"
        "with SandboxPool(Limits(workers=1, isolation='namespaces')) as pool:\n"
        "    [o] = pool.run([('moerl.tasks.verifiers:positional', ['123', '120'])])\n"
        "print(json.dumps([o.kind, o.value, o.error]))"
    )
    env = {"PATH": os.environ["PATH"], "LANG": "C.UTF-8", "TMPDIR": str(ROOT.parent)}
    got = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert json.loads(got.stdout.strip().splitlines()[-1]) == ["ok", 2 / 3, ""]
