"""The S3 exchange between a KFP task and the pod it launches.

Design, details and limitations: docs/launch.md#moerllaunchexchangepy.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError
from moerl.store.s3 import S3Store

SPEC, RESULT = "spec.json", "result.json"


def node_result(node_rank: int) -> str:
    """The result of node `node_rank` > 0 of a multi-node workload (node 0 writes RESULT)."""
    return f"result-node-{node_rank}.json"


class _ExchangeStore(S3Store):
    """The store's S3 client, with whole-object transfers at any key under its prefix."""

    def put_file(self, key: str, src: Path) -> None:
        with self._errors(f"uploading {key}"):
            self._s3.upload_file(str(src), self.bucket, self._key(key), Config=self._transfer)

    def get_file(self, key: str, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with self._errors(f"downloading {key}"):
            self._s3.download_file(self.bucket, self._key(key), str(dest), Config=self._transfer)


def exchange_uri(ckpt: CheckpointConfig, run_id: str, key: str) -> str:
    if not ckpt.uri.startswith("s3://"):
        raise ValueError("the exchange needs an s3:// checkpoint.uri")
    return f"{ckpt.uri.rstrip('/')}/runs/{run_id}/exchange/{key}"


def safe_rel(rel: str) -> str:
    """A relative POSIX path that stays inside its folder (it comes from an S3 object)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or ".." in p.parts or "\\" in rel:
        raise CheckpointError(
            f"refusing exchange path {rel!r}: not a relative path inside its folder"
        )
    return p.as_posix()


class Exchange:
    """One task's exchange prefix. `ckpt` supplies the S3 settings (endpoint, region, retries);
    its `uri` is replaced by `uri`."""

    def __init__(self, ckpt: CheckpointConfig, uri: str) -> None:
        self.uri = uri.rstrip("/")
        self._store = _ExchangeStore(ckpt.model_copy(update={"uri": self.uri}))

    def put(self, prefix: str, local: Path) -> dict[str, Any]:
        """Upload a file or a directory tree; returns its description for the spec/result."""
        local = Path(local)
        if local.is_file():
            self._store.put_file(prefix, local)
            return {"kind": "file"}
        if local.is_dir():
            files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
            for rel in files:
                self._store.put_file(f"{prefix}/{rel}", local / rel)
            return {"kind": "dir", "files": files}
        return {"kind": "missing"}

    def get(self, prefix: str, desc: dict[str, Any], dest: Path) -> Path:
        """Download what `put` described into `dest` (a file, or a directory it creates)."""
        dest = Path(dest)
        kind = desc.get("kind")
        if kind == "file":
            self._store.get_file(prefix, dest)
        elif kind == "dir":
            dest.mkdir(parents=True, exist_ok=True)
            for rel in desc.get("files", []):
                self._store.get_file(f"{prefix}/{safe_rel(rel)}", dest / safe_rel(rel))
        else:
            raise CheckpointError(f"{self.uri}/{prefix} holds nothing to download (kind {kind!r})")
        return dest

    def write_json(self, key: str, obj: Any) -> None:
        self._store._write_text(key, json.dumps(obj))

    def read_json(self, key: str) -> Any | None:
        text = self._store._read_text(key)
        if text is None:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            raise CheckpointError(
                f"{self.uri}/{key} is not JSON ({e}); the exchange is corrupt"
            ) from e

    def keys(self) -> list[str]:
        return self._store._list("")

    def clear(self) -> int:
        """Delete every object under the prefix; returns how many there were."""
        keys = self.keys()
        self._store._delete(keys)
        return len(keys)
