"""A real MLflow tracking server on loopback, over a sqlite store, for the tests.

`mlflow server` ignores basic-auth credentials, which lets the tests hand it a URI that carries
a password and check where that password ends up. Its background job runner (a dozen huey
processes) is turned off: nothing here uses it and it triples the start-up time.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moerl.launch import procs


def _free_port() -> int:
    # probe-then-use: fine for a test server that is retried below if the port was taken
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def mlflow_server(
    root: Path, attempts: int = 3, admin: tuple[str, str] | None = None
) -> Iterator[str]:
    """Start `mlflow server` with its store at root/mlflow.db; yield http://127.0.0.1:PORT;
    stop its whole process group afterwards (it dies with this thread in any case). `admin`:
    behind MLflow's basic-auth app (`--app-name basic-auth`, users in root/auth.db, every user
    READ where not granted more), with this admin user and password."""
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    env.pop("MLFLOW_TRACKING_URI", None)
    extra: list[str] = []
    if admin is not None:
        ini = root / "basic_auth.ini"
        ini.write_text(
            f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{root / 'auth.db'}\n"
        )
        env |= {
            "MLFLOW_AUTH_CONFIG_PATH": str(ini),
            "MLFLOW_AUTH_ADMIN_USERNAME": admin[0],
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin[1],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": os.urandom(16).hex(),
        }
        extra = ["--app-name", "basic-auth"]
    for _ in range(attempts):
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with (root / "server.log").open("ab") as log:
            proc = procs.spawn(
                "mlflow",
                [
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--workers",
                    "1",
                    "--backend-store-uri",
                    f"sqlite:///{root / 'mlflow.db'}",
                    "--default-artifact-root",
                    str(root / "artifacts"),
                    *extra,
                ],
                env,
                stdout=log,
                stderr=log,
            )
        try:
            if _wait_healthy(url, proc, 180):
                yield url
                return
        finally:
            procs.kill_groups([proc], grace_s=5)
    raise RuntimeError(f"mlflow server did not start; see {root / 'server.log'}")


def _wait_healthy(url: str, proc, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False
