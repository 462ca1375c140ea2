"""Where a version's files are stored: under the object folder its manifest names (on S3 each
publish's own, `versions/<version dir>/<objects>/<path>`; a folder store's first tier,
`versions/<version dir>/<path>`), read back from the store rather than assumed."""

from __future__ import annotations

from collections.abc import Iterable

from moerl.store.base import CheckpointStore
from moerl.store.manifest import Manifest, files_dir, version_dir


def files_prefix(manifest: Manifest) -> str:
    """The folder of `manifest`'s files, relative to the store's root, ending in "/"."""
    return f"versions/{files_dir(version_dir(manifest.version), manifest.objects)}/"


def file_key(store: CheckpointStore, version: int, rel: str) -> str:
    """The key (relative to the store's root) of `rel` of `version`, as its manifest places it."""
    return files_prefix(store.manifest(version)) + rel


def in_version(manifest: Manifest, paths: Iterable[str]) -> set[str]:
    """The keys of `paths` of `manifest`'s files, relative to the version's folder (where its
    manifest and claim are): under the manifest's object folder where it names one."""
    return {f"{manifest.objects}/{p}" if manifest.objects else p for p in paths}
