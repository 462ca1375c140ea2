"""The manifest of a policy version: every file's path, size and sha256, as canonical JSON.

A version is complete once its manifest is stored (see `moerl.store.base`); the manifest's own
sha256 identifies the version's exact bytes (`latest.json`, fetched copies and `PolicyVersion`
records carry it). With `chunk_size` set, each file also lists the sha256 of every
`chunk_size` bytes, so a copy assembled from several sources (peers, the cache tier, S3) is
checked chunk by chunk as it arrives (`moerl.store.fanout`); manifests without chunks (older
versions) keep their exact JSON and sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from moerl.errors import CheckpointError

MANIFEST = "manifest.json"


def version_dir(version: int) -> str:
    return f"v{version:06d}"


_OBJECTS = re.compile(r"^[0-9a-z]{1,64}$")


def new_objects() -> str:
    """A publish's own object folder: the version's files go under
    `versions/<version dir>/<objects>/`, and its manifest names the folder. An upload of a
    writer fenced meanwhile can only land in that writer's own folder, never on a key the
    manifest of the version's new writer names."""
    return "o" + secrets.token_hex(8)


def files_dir(stage: str, objects: str) -> str:
    """Where a version's files are, under `versions/`: `stage`, or its `objects` folder."""
    return f"{stage}/{objects}" if objects else stage


def sha256_file(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_file(
    path: str | os.PathLike[str], chunk_size: int = 0
) -> tuple[int, str, tuple[str, ...]]:
    """Size, sha256 and (with `chunk_size`) the sha256 of each chunk, in one read pass."""
    if not chunk_size:
        return os.stat(path).st_size, sha256_file(path), ()
    whole, chunks, size = hashlib.sha256(), [], 0
    buf = bytearray(min(chunk_size, 8 * 2**20))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        part, filled = hashlib.sha256(), 0
        while n := f.readinto(view[: min(len(buf), chunk_size - filled)]):
            whole.update(view[:n])
            part.update(view[:n])
            filled += n
            size += n
            if filled == chunk_size:
                chunks.append(part.hexdigest())
                part, filled = hashlib.sha256(), 0
        if filled or not chunks:
            chunks.append(part.hexdigest())
    return size, whole.hexdigest(), tuple(chunks)


class BlockHasher:
    """Size, sha256 and per-`chunk_size` sha256s of bytes fed in any blocks (`hash_file`'s
    result for a stream: a file read from a source while it is copied)."""

    def __init__(self, chunk_size: int = 0) -> None:
        self.chunk_size, self.size, self.whole = chunk_size, 0, hashlib.sha256()
        self.chunks: list[str] = []
        self._part, self._filled = hashlib.sha256(), 0

    def update(self, data: bytes | memoryview) -> None:
        self.whole.update(data)
        self.size += len(data)
        if not self.chunk_size:
            return
        view = memoryview(data)
        while view:
            n = min(len(view), self.chunk_size - self._filled)
            self._part.update(view[:n])
            self._filled += n
            view = view[n:]
            if self._filled == self.chunk_size:
                self.chunks.append(self._part.hexdigest())
                self._part, self._filled = hashlib.sha256(), 0

    def result(self) -> tuple[int, str, tuple[str, ...]]:
        if self.chunk_size and (self._filled or not self.chunks):
            self.chunks.append(self._part.hexdigest())
            self._filled = 0
        return self.size, self.whole.hexdigest(), tuple(self.chunks)


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the version directory, '/'-separated
    size: int
    sha256: str
    chunks: tuple[str, ...] = ()  # sha256 of each `Manifest.chunk_size` bytes; () without chunks


@dataclass(frozen=True)
class Manifest:
    version: int
    files: tuple[FileEntry, ...]
    created_at: str  # UTC, ISO 8601
    meta: dict[str, str] = field(default_factory=dict)  # small labels: git sha, run id, ...
    chunk_size: int = 0  # bytes per chunk hash; 0: files are hashed whole only
    # the folder under the version's directory that holds its files (`new_objects`); "": the
    # directory itself (folders, which stage privately, and versions written before)
    objects: str = ""

    def to_json(self) -> str:
        files = [
            {
                "path": f.path,
                "size": f.size,
                "sha256": f.sha256,
                **({"chunks": list(f.chunks)} if f.chunks else {}),
            }
            for f in self.files
        ]
        body = {
            "version": self.version,
            "created_at": self.created_at,
            "meta": dict(sorted(self.meta.items())),
            **({"chunk_size": self.chunk_size} if self.chunk_size else {}),
            **({"objects": self.objects} if self.objects else {}),
            "files": files,
        }
        return json.dumps(body, indent=1) + "\n"

    @staticmethod
    def from_json(text: str) -> Manifest:
        try:
            d = json.loads(text)
            files = tuple(
                FileEntry(
                    str(f["path"]),
                    int(f["size"]),
                    str(f["sha256"]),
                    tuple(str(c) for c in f.get("chunks", ())),
                )
                for f in d["files"]
            )
            meta = {str(k): str(v) for k, v in d.get("meta", {}).items()}
            m = Manifest(
                int(d["version"]),
                files,
                str(d["created_at"]),
                meta,
                int(d.get("chunk_size", 0)),
                str(d.get("objects", "")),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"malformed manifest ({e!r}); republish this version") from e
        if m.chunk_size < 0 or any(
            len(f.chunks) != (m.n_chunks(f) if m.chunk_size else 0) for f in m.files
        ):
            raise CheckpointError(
                f"manifest of version {m.version} lists chunks that do not cover its files "
                f"(chunk_size {m.chunk_size}); republish this version"
            )
        if m.objects and not _OBJECTS.match(m.objects):  # nor read outside the version's
            raise CheckpointError(
                f"manifest of version {m.version} names an unsafe object folder {m.objects!r}"
            )
        for f in m.files:  # a manifest must not make fetch write outside its folder
            p = PurePosixPath(f.path)
            if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in f.path:
                raise CheckpointError(
                    f"manifest of version {m.version} has an unsafe path {f.path!r}"
                )
        return m

    def n_chunks(self, f: FileEntry) -> int:
        return max(1, -(-f.size // self.chunk_size)) if self.chunk_size else 1

    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()
