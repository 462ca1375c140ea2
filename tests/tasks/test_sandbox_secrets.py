"""A sandboxed child cannot read the stage's credential files: with isolation
`namespaces` the directories of the stage's `<credential>_FILE`s (on EKS its Secret volumes under
/var/run/secrets/moerl) are hidden under an empty tmpfs, whatever the files' mode; with `none`
the same read succeeds (the control, so the assertion could fail). Real processes: a stage runs
the reward stage's `score` on its own pool, as in tests/tasks/test_sandbox_isolation.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moerl.secrets import write_secret_file

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "run-user-password-not-for-sandboxes"

STAGE = textwrap.dedent("""
    import json, os, sys
    from moerl.components.reward.stage import score
    from moerl.config import RewardConfig
    from moerl.records import Sample
    from moerl.secrets import read_secret
    iso, path = sys.argv[1], sys.argv[2]
    assert read_secret("VALKEY_PASSWORD") == sys.argv[3]  # the stage itself reads its file
    def sample(i, text):
        return Sample(prompt_id="p0", task="copy", prompt="x", answer=sys.argv[3], sample_index=i,
                      prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[-0.5],
                      response_text=text, finish_reason="stop", policy_version=0)
    cfg = RewardConfig(verifier="tests.support.secret_readers:reads", max_failed_fraction=1.0,
                       sandbox={"sample_timeout_s": 20.0, "workers": 1, "isolation": iso})
    scored = score([sample(0, path), sample(1, os.path.join(os.path.dirname(os.path.dirname(path)), "other"))], cfg)
    print(json.dumps([[s.reward, s.reward_error] for s in scored]))
""")


def _stage(isolation: str, tmp_path: Path) -> list:
    secret = write_secret_file(
        tmp_path / "pod" / "secrets" / "moerl-run" / "VALKEY_PASSWORD", PASSWORD
    )
    # a sibling outside the file's own directory
    (tmp_path / "pod" / "secrets" / "other").write_text(PASSWORD)
    (tmp_path / "t").mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "LANG": "C.UTF-8",
        "TMPDIR": str(tmp_path / "t"),
        "VALKEY_PASSWORD_FILE": str(secret),
    }
    got = subprocess.run(
        [sys.executable, "-c", STAGE, isolation, str(secret), PASSWORD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return json.loads(got.stdout.strip().splitlines()[-1])


def test_without_isolation_a_child_reads_the_stages_credential_file(tmp_path):
    assert _stage("none", tmp_path) == [[1.0, None], [1.0, None]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="namespaces: Linux only")
def test_an_isolated_child_finds_no_credential_file_of_its_stage(tmp_path):
    (hidden, sibling) = _stage("namespaces", tmp_path)
    assert hidden[0] == 0.0 and hidden[1].startswith("FileNotFoundError"), hidden
    # only the credential's own directory goes: the rest stays readable (read-only), as before
    assert sibling == [1.0, None]
