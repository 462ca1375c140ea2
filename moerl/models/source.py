"""Where the policy comes from (`model.path`): a local HF folder, `s3://bucket/prefix/` (HF
layout: config.json, tokenizer, *.safetensors with their index) or `hf://org/name@<commit>`
(a model hub, where the cluster reaches one; a pinned 40-hex commit, never a moving branch).
Preflight checks a remote model from its small files and, for S3, its safetensors headers
read by ranged GETs (`check_model`), before any engine or trainer starts; every stage that
needs its config or tokenizer reads a local copy of the small files (`model_view`).
`init_policy` imports it once into version 0 of the run (`ModelImport`): each weight file is
copied server-side where the store is on the same S3 service (never through the pod's disk),
or streamed, hashed on the way into the manifest the store then verifies, and the run is
tagged with the source, its ETags and family (`source_tags`).

Design, details and limitations: docs/models.md#bringing-a-model-from-s3-or-a-hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from moerl.config import CheckpointConfig
from moerl.errors import CheckpointError, ConfigError, SourceChanged
from moerl.store.manifest import BlockHasher, FileEntry, Manifest
from moerl.store.sources import S3Object, S3Source

HF_URI = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>.*))?$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
WEIGHTS = ".safetensors"
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
SMALL_CAP = 64 << 20  # a tokenizer.json of a large vocabulary is ~10 MiB; no small file is more
VIEW_DONE = ".moerl-view-complete"
# the hub's files a preflight needs: everything but the weights
HF_SMALL = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", "merges.txt"]


def is_remote(spec: str | None) -> bool:
    """Whether `model.path` names a remote source (S3 or a hub) rather than a local folder."""
    return bool(spec) and str(spec).startswith(("s3://", "hf://"))


def hf_ref(spec: str) -> tuple[str, str]:
    """(repo id, commit) of `hf://org/name@<commit>`; ConfigError naming model.path otherwise."""
    m = HF_URI.match(spec)
    if not m:
        raise ConfigError(f"model.path: {spec!r} is not hf://org/name@<commit>")
    rev = m["rev"]
    if not rev or not COMMIT.match(rev):
        raise ConfigError(
            f"model.path: {spec!r} needs a pinned revision: hf://{m['repo']}@<40-hex commit sha> "
            f"(got {'none' if not rev else repr(rev)}); a branch or tag can move under a run"
        )
    return m["repo"], rev


def hf_snapshot(spec: str, small_only: bool = False) -> Path:
    """The hub snapshot of `spec` in the local hub cache (HF_HUB_CACHE), downloaded once if the
    cache lacks it (none with HF_HUB_OFFLINE=1: a cache filled beforehand, a mirror folder);
    `small_only`: every file but the weights."""
    from huggingface_hub import snapshot_download

    repo, rev = hf_ref(spec)
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    try:
        return Path(
            snapshot_download(
                repo,
                revision=rev,
                cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                local_files_only=offline,
                allow_patterns=HF_SMALL if small_only else None,
            )
        )
    except Exception as err:  # noqa: BLE001 - the hub client raises many kinds; all name the cause
        raise ConfigError(
            f"model.path: cannot get {spec} from the hub ({type(err).__name__}: {err}); check the "
            "repo, the commit, HF_TOKEN and that the cluster reaches the hub (HF_HUB_OFFLINE="
            f"{'1' if offline else '0'})"
        ) from None


class S3Model:
    """A model under `s3://bucket/prefix/`: its top-level files, listed once with their ETags
    (a file rewritten after the listing is refused at its next read)."""

    def __init__(self, uri: str, ck: CheckpointConfig) -> None:
        self.uri = uri if uri.endswith("/") else uri + "/"
        self.source = S3Source(self.uri, ck, "model.path", ConfigError)
        self.endpoint_url = ck.endpoint_url
        listed = self.source.list()
        # the HF layout is flat; a subfolder (a repo's original/ weights) is not the model
        self.objects = {o.rel: o for o in listed if "/" not in o.rel}
        if "config.json" not in self.objects:
            raise ConfigError(
                f"model.path: {self.uri} is not a HF checkpoint (no config.json among its "
                f"{len(listed)} objects)"
            )
        self.weights = sorted(r for r in self.objects if r.endswith(WEIGHTS))
        # other formats' weights (a repo's pytorch_model*.bin, consolidated*.pth, *.gguf) are
        # not the model moerl loads: neither fetched nor imported
        self.ignored = sorted(r for r in self.objects if r.endswith(OTHER_WEIGHTS))
        self.small = sorted(
            r for r in self.objects if r not in self.weights and r not in self.ignored
        )

    def digest(self) -> str:
        """sha256 over every file's path, size and ETag: what the run was given."""
        lines = "".join(f"{o.rel}\t{o.size}\t{o.etag}\n" for _, o in sorted(self.objects.items()))
        return hashlib.sha256(lines.encode()).hexdigest()

    def fetch_small(self, dest: Path) -> None:
        """Write every file but the weights into `dest` (each at most SMALL_CAP bytes)."""
        for rel in self.small:
            (dest / rel).write_bytes(self.source.read(self.objects[rel], cap=SMALL_CAP))

    def check(self, view: Path) -> str:
        """`check_checkpoint`'s checks, the headers read by ranged GETs. Returns the model_type."""
        from moerl.models.policy import check_model_files, check_safetensors_header

        def header(rel: str) -> object:
            obj = self.objects[rel]
            return check_safetensors_header(
                lambda start, n: self.source.read_range(obj, start, n),
                obj.size,
                self.source.url(rel),
            )

        return check_model_files(view, self.uri, self.weights, header)


def model_view(spec: str, ck: CheckpointConfig) -> Path:
    """A local folder with `model.path`'s config, tokenizer and other small files (a local
    path is its own): what preflight, the engines' skeleton and the checks read. A remote one
    is fetched once per node into checkpoint.cache_dir/sources/<digest>, atomically."""
    if spec.startswith("hf://"):
        return hf_snapshot(spec, small_only=True)
    if not spec.startswith("s3://"):
        return Path(spec).expanduser()
    model = S3Model(spec, ck)
    return _s3_view(model, ck)


def _s3_view(model: S3Model, ck: CheckpointConfig) -> Path:
    root = Path(ck.cache_dir).expanduser() / "sources"
    dest = root / model.digest()[:24]
    if (dest / VIEW_DONE).is_file():
        return dest
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=root))
    try:
        model.fetch_small(tmp)
        (tmp / VIEW_DONE).write_text(model.uri + "\n")
        try:
            os.replace(tmp, dest)
        except OSError:  # a neighbour finished first
            if not (dest / VIEW_DONE).is_file():
                shutil.rmtree(dest, ignore_errors=True)
                os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def check_model(spec: str, ck: CheckpointConfig) -> str:
    """Preflight of `model.path` wherever it lives; the model_type. An unreadable, missing or
    unsupported model: a ConfigError naming model.path and the key. A hub model's headers are
    checked at its import (its weights are not fetched before)."""
    from moerl.models.policy import check_checkpoint, check_model_files

    if spec.startswith("s3://"):
        model = S3Model(spec, ck)
        return model.check(_s3_view(model, ck))
    if spec.startswith("hf://"):
        view = hf_snapshot(spec, small_only=True)
        weights = _indexed_weights(view)
        return check_model_files(view, spec, weights, lambda _: None)
    return check_checkpoint(spec)


def _indexed_weights(view: Path) -> list[str]:
    """The weight files a hub snapshot's index names (or the one unsharded file)."""
    index = view / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    return ["model.safetensors"]


def hf_config(spec: str, ck: CheckpointConfig) -> dict:
    """`model.path`'s config.json, wherever it lives."""
    return json.loads((model_view(spec, ck) / "config.json").read_text())


def local_model(spec: str, ck: CheckpointConfig, dest: Path) -> Path:
    """A whole local copy of `model.path` (a local folder is its own; a hub snapshot is the
    hub cache's; an S3 model is streamed into `dest`, checked first): for a stage that loads
    the weights itself (the reward model's backbone)."""
    if spec.startswith("hf://"):
        return hf_snapshot(spec)
    if not spec.startswith("s3://"):
        return Path(spec).expanduser()
    model = S3Model(spec, ck)
    model.check(_s3_view(model, ck))
    dest.mkdir(parents=True, exist_ok=True)
    model.fetch_small(dest)
    for rel in model.weights:
        with open(dest / rel, "wb") as f:
            for block in model.source.stream(model.objects[rel]):
                f.write(block)
    return dest


class ModelImport:
    """The weights of an S3 model as the parts of version 0 (`CheckpointStore.publish(parts=)`):
    each file copied into the store's stage server-side when the store is on the same S3
    service (`S3Store.copy_in`) and otherwise streamed (`put_stream`), hashed as the source is
    read either way; the store then checks each object against the manifest. `routes` counts
    how each file went."""

    def __init__(self, model: S3Model) -> None:
        self.model = model
        self.tiers: list[Counter[str]] = []  # each store's routes, in publish order
        self.nbytes = sum(model.objects[r].size for r in model.weights)  # `check_tier_fits`

    @property
    def routes(self) -> Counter[str]:
        """How the weight files went, over every store they were put into."""
        return sum(self.tiers, Counter())

    def put(self, store, version, stage, claim, manifest: Manifest | None, chunk_size: int):
        from moerl.store.s3 import S3Store

        m, src, at = self.model, self.model.source, stage  # `stage`: the publish's files folder
        routes: Counter[str] = Counter()
        self.tiers.append(routes)
        listed = {e.path: e for e in manifest.files} if manifest is not None else {}
        server = isinstance(store, S3Store) and store.same_service(m.endpoint_url)

        def one(rel: str) -> FileEntry:
            obj: S3Object = m.objects[rel]
            if claim is not None:
                store._check_claim(version, claim)
            known = listed.get(rel)
            if manifest is not None and (known is None or known.size != obj.size):
                raise CheckpointError(
                    f"version {version}: {src.url(rel)} is not in the manifest as listed; the "
                    "source changed under the import"
                )
            hasher = BlockHasher(chunk_size)
            if server and store.holds(rel):
                try:
                    route = store.copy_in(at, rel, src.bucket, src.key_of(rel), obj.size, obj.etag)
                except SourceChanged as e:
                    raise SourceChanged(
                        f"model.path: {e}; a source must not change under a run: write a new "
                        "prefix and start a new run"
                    ) from None
                except CheckpointError as e:  # gone, or the role may not read it
                    raise CheckpointError(f"model.path: importing {src.url(rel)}: {e}") from None
                if known is None:
                    for block in src.stream(obj):
                        hasher.update(block)
            elif store.holds(rel):
                route = "stream"

                def blocks():
                    for block in src.stream(obj):
                        hasher.update(block)
                        yield block

                store.put_stream(at, rel, blocks(), obj.size)
            else:
                route = "hash only"
                if known is None:
                    for block in src.stream(obj):
                        hasher.update(block)
            entry = known or FileEntry(rel, *hasher.result())
            if hasher.size and hasher.whole.hexdigest() != entry.sha256:
                raise CheckpointError(
                    f"version {version}: {src.url(rel)} read back other bytes than the manifest "
                    "lists; the source changed under the import"
                )
            routes[route] += 1
            return entry

        return store._map(one, m.weights)
