"""Valkey memory pressure on a real server shared by two runs: one run filling `maxmemory` makes
the other's writes wait (retried with backoff, counted) instead of failing at once; before,
`Retrying` retried only connection errors, so the other run's issuer raised OutOfMemoryError
at its first write and its trainer exited."""

from __future__ import annotations

import threading
import time

import pytest

from moerl.bus import EmbeddedValkey, RunBus, connect


@pytest.fixture
def full(tmp_path):
    """A server whose maxmemory another run ("hog") has filled; yields (server, admin, hog keys)."""
    import valkey

    with EmbeddedValkey(tmp_path / "valkey", appendonly=False) as v:
        admin = valkey.Valkey.from_url(v.url, decode_responses=True)
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used + 4_000_000)
        admin.config_set("maxmemory-policy", "noeviction")
        keys = []
        with pytest.raises(valkey.exceptions.OutOfMemoryError):
            for i in range(1_000_000):
                admin.set(f"moerl:hog:k{i}", "x" * 200)
                keys.append(f"moerl:hog:k{i}")
        yield v, admin, keys


def test_a_run_waits_out_another_runs_full_memory_and_goes_on_exactly_once(full):
    v, admin, hog = full
    bus = RunBus(connect(v.url, 30), "victim")
    done: dict[str, object] = {}

    def issue_and_publish() -> None:
        try:
            done["unit"] = bus.issue_unit([{"id": "p0", "prompt": "x"}])
            done["added"] = bus.publish_group("u0000001/0:p0", [{"response_token_ids": [1]}])
        except BaseException as err:  # noqa: BLE001 - asserted below
            done["error"] = err

    t = threading.Thread(target=issue_and_publish)
    t.start()
    time.sleep(1.5)
    assert t.is_alive() and not done, done  # waiting, not failed
    admin.delete(*hog)  # the other run ends; its memory frees
    t.join(timeout=20)
    assert "error" not in done, done.get("error")
    assert done == {"unit": "u0000001", "added": True}
    c = bus.counters()
    # each write exactly once (refused before it ran, so the resend is the only run)
    assert (c["units_issued"], c["prompts_issued"], c["groups_generated"]) == (1, 1, 1)
    assert c["valkey_oom_refusals"] >= 1  # counted once the server had room again


def test_memory_that_never_frees_fails_in_bounded_time_naming_the_cause(full):
    v, _, _ = full
    bus = RunBus(connect(v.url, 1.5), "victim")
    t0 = time.monotonic()
    with pytest.raises(Exception, match=r"Valkey out of memory for 2 s \(valkey.reconnect_s\)"):
        bus.issue_unit([{"id": "p0", "prompt": "x"}])
    assert time.monotonic() - t0 < 10
