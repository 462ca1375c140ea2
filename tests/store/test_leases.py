"""Pins are leases: a holder that stops renewing stops protecting its version from retention.

The lease logic runs with an injected clock; retention across several holder processes, one of
which is SIGKILLed, runs in real time with a 2 s TTL, against a local folder and real S3 (weed).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moerl.errors import CheckpointError
from moerl.store.base import CheckpointStore
from moerl.store.leases import Lease, new_lease, parse_lease
from tests.store.test_store import Case, case, make_checkpoint  # noqa: F401 (case: a fixture)
from tests.store.test_store_faults import _wait_for

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z


def test_lease_json_roundtrip_and_expiry() -> None:
    lease = new_lease(3, "engine-0", now=T0, ttl_s=60)
    assert lease == Lease(3, "engine-0", T0, T0 + 60)
    assert json.loads(lease.to_json())["expires_at"] == "2026-01-01T00:01:00.000+00:00"
    assert parse_lease("pins/engine-0.json", lease.to_json(), default_ttl_s=1) == lease
    assert lease.live(T0 + 59.9) and not lease.live(T0 + 60)
    with pytest.raises(CheckpointError, match="TTL must be > 0 seconds, got 0"):
        new_lease(3, "engine-0", now=T0, ttl_s=0)


def test_pins_written_before_leases_expire_after_the_default_ttl() -> None:
    old = json.dumps(
        {"version": 4, "holder": "serving-pod-1", "pinned_at": "2026-01-01T00:00:00+00:00"}
    )
    lease = parse_lease("pins/serving-pod-1.json", old, default_ttl_s=3600)
    assert lease.version == 4 and lease.live(T0 + 3599) and not lease.live(T0 + 3600)
    for bad in ("not json", '{"version": 1}', '{"version": 1, "pinned_at": "2026-01-01T00:00:00"}'):
        with pytest.raises(CheckpointError, match="malformed pin pins/x.json"):
            parse_lease("pins/x.json", bad, default_ttl_s=1)


def test_expired_lease_stops_protecting_its_version(case: Case, tmp_path: Path) -> None:  # noqa: F811
    """Three holders pin versions 1, 2, 3; b dies (stops renewing). After its TTL version 2
    and b's pin file go; a's and c's versions stay as long as they renew."""
    store, clock = case.store, [T0]
    store.clock = lambda: clock[0]
    src = make_checkpoint(tmp_path / "src")
    for v in (1, 2, 3, 4):
        store.publish(v, src)
    for holder, v in (("a", 1), ("b", 2), ("c", 3)):
        store.pin(v, holder, ttl_s=10)
    clock[0] += 6
    assert store.renew("a", ttl_s=10) == 1 and store.renew("c", ttl_s=10) == 3  # b is dead
    assert store.pinned() == {1, 2, 3} and store.apply_retention(keep_last=1, keep_every=0) == []
    clock[0] += 6  # b's lease ran out at T0 + 10; a's and c's run to T0 + 16
    assert store.pinned() == {1, 3}
    assert store.apply_retention(keep_last=1, keep_every=0) == [2]
    assert store.versions() == [1, 3, 4] and sorted(store._list("pins/")) == [
        "pins/a.json",
        "pins/c.json",
    ]
    with pytest.raises(CheckpointError, match="'b' holds no pin"):
        store.renew("b")
    clock[0] += 6  # nobody renewed: everything but keep_last goes
    with pytest.raises(
        CheckpointError, match=r"pin of 'a' on version 1 .* expired at 2026-01-01T00:00:16"
    ):
        store.renew("a")
    assert store.apply_retention(keep_last=1, keep_every=0) == [1, 3] and store._list("pins/") == []


def test_store_default_ttl_comes_from_the_config(tmp_path: Path) -> None:
    from moerl.config import CheckpointConfig
    from moerl.store.runs import open_store

    store = open_store(CheckpointConfig(uri=str(tmp_path / "s"), pin_ttl_s=30))
    store.clock = lambda: T0
    store.publish(1, make_checkpoint(tmp_path / "src"))
    store.pin(1, "engine-0")
    lease = parse_lease("k", store._read_text("pins/engine-0.json"), 1)
    assert lease.expires_at == T0 + 30


_HOLDER = r"""
import json, sys, time
from pathlib import Path
from moerl.config import CheckpointConfig
from moerl.store.runs import open_store
a = json.loads(sys.argv[1])
store = open_store(CheckpointConfig(**a["cfg"]))
store.pin(a["version"], a["holder"], ttl_s=a["ttl_s"])
Path(a["ready"]).touch()
while True:  # a live engine renews well within its TTL
    time.sleep(a["ttl_s"] / 5)
    store.renew(a["holder"], ttl_s=a["ttl_s"])
"""


def _cfg_of(store: CheckpointStore) -> dict:
    if store.uri.startswith("s3://"):
        return {
            "uri": store.uri,
            "endpoint_url": store._s3.meta.endpoint_url,
            "region": "us-east-1",
        }
    return {"uri": store.uri}


def test_dead_holder_loses_its_version_live_holders_keep_theirs(case: Case, tmp_path: Path) -> None:  # noqa: F811
    store, ttl = case.store, 2.0
    src = make_checkpoint(tmp_path / "src")
    for v in (1, 2, 3, 4):
        store.publish(v, src)
    procs = {}
    try:
        for holder, v in (("engine-a", 1), ("engine-b", 2), ("engine-c", 3)):
            args = {
                "cfg": _cfg_of(store),
                "version": v,
                "holder": holder,
                "ttl_s": ttl,
                "ready": str(tmp_path / holder),
            }
            procs[holder] = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, json.dumps(args)],
                text=True,
                stderr=subprocess.PIPE,
                cwd=Path(__file__).parents[2],
            )
        for holder, p in procs.items():
            _wait_for(lambda h=holder: (tmp_path / h).exists(), 60, f"{holder} to pin", p)
        procs["engine-b"].send_signal(signal.SIGKILL)
        procs["engine-b"].wait(timeout=10)
        killed = time.monotonic()
        assert store.apply_retention(keep_last=1, keep_every=0) == []  # b's lease still runs
        deleted: list[int] = []
        while not deleted:
            assert time.monotonic() - killed < ttl + 10, "the dead holder's lease never expired"
            time.sleep(0.2)
            deleted = store.apply_retention(keep_last=1, keep_every=0)
        assert deleted == [2] and time.monotonic() - killed <= ttl + 10
        for holder in ("engine-a", "engine-c"):
            # renewals worked
            assert procs[holder].poll() is None, procs[holder].stderr.read()[-2000:]
        assert store.versions() == [1, 3, 4] and store.pinned() == {1, 3}
        assert "pins/engine-b.json" not in store._list("pins/")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
