"""The manifest of a policy version: every file's path, size and sha256, as canonical JSON.

A version is complete once its manifest is stored (see `moerl.store.base`); the manifest's own
sha256 identifies the version's exact bytes (`latest.json`, fetched copies and `PolicyVersion`
records carry it).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from moerl.errors import CheckpointError

MANIFEST = "manifest.json"


def version_dir(version: int) -> str:
    return f"v{version:06d}"


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the version directory, '/'-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    version: int
    files: tuple[FileEntry, ...]
    created_at: str  # UTC, ISO 8601
    meta: dict[str, str] = field(default_factory=dict)  # small labels: git sha, run id, ...

    def to_json(self) -> str:
        files = [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in self.files]
        body = {"version": self.version, "created_at": self.created_at,
                "meta": dict(sorted(self.meta.items())), "files": files}
        return json.dumps(body, indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> Manifest:
        try:
            d = json.loads(text)
            files = tuple(FileEntry(str(f["path"]), int(f["size"]), str(f["sha256"])) for f in d["files"])
            meta = {str(k): str(v) for k, v in d.get("meta", {}).items()}
            m = Manifest(int(d["version"]), files, str(d["created_at"]), meta)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"malformed manifest ({e!r}); republish this version") from e
        for f in m.files:  # a manifest must not make fetch write outside its folder
            p = PurePosixPath(f.path)
            if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in f.path:
                raise CheckpointError(f"manifest of version {m.version} has an unsafe path {f.path!r}")
        return m

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()
