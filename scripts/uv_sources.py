"""Print uv flags for the package sources pip is configured with (setup installs with uv).

uv does not read pip's configuration, so `make setup` asks pip (`pip config list`, which
covers the config files and the PIP_* environment) for find-links, index-url and
extra-index-url, and hands them to `uv pip install`. A `file://` index or a find-links
directory that does not exist is left out (pip warns and ignores it; uv would fail).

    python scripts/uv_sources.py    ->  --find-links /opt/wheels --extra-index-url file:///...
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

FLAGS = {
    "find-links": "--find-links",
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
}


def _exists(value: str) -> bool:
    if value.startswith("file://"):
        return os.path.exists(value[len("file://") :])
    if "://" in value:
        return True
    return os.path.exists(value)


def sources(config_list: str) -> list[str]:
    """uv flags from `pip config list` output (lines like `global.find-links='/opt/wheels'`)."""
    seen: dict[str, list[str]] = {k: [] for k in FLAGS}
    for line in config_list.splitlines():
        key, _, raw = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name not in FLAGS:
            continue
        for value in shlex.split(raw)[0].split() if raw else []:
            if value not in seen[name] and _exists(value):
                seen[name].append(value)
    out: list[str] = []
    for name, values in seen.items():
        if name == "index-url":
            values = values[-1:]  # one primary index
        for v in values:
            out += [FLAGS[name], v]
    return out


def main() -> int:
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    print(" ".join(shlex.quote(x) for x in sources(listing)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
