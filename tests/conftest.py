"""Shared session fixtures (one real S3 server, the gloo worlds of the comparison modules) and
the suite's tiers, work units and order (tests/support/tiers.py; docs/testing.md says how the
tiers work)."""

from tests.support.gloo_world import gloo_worlds  # noqa: F401  (a session fixture, registered here)
from tests.support.s3server import s3_server  # noqa: F401  (a session fixture, registered here)

pytest_plugins = ["tests.support.tiers", "pytester"]
