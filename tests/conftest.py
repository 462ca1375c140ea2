"""Shared fixtures: one real S3 server (weed mini) per test session."""

from tests.s3server import s3_server  # noqa: F401  (a session fixture, registered here)
