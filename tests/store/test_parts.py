"""One version written by several processes: the trainer mesh's other nodes put their own files
into the publication rank 0's publisher runs (`CheckpointStore.publish(parts=...)`,
`put_parts`), through the mesh's rendezvous store (`NodeParts`, `Uploader` in
components/policy_update/mesh.py), and the fencing of those writes (moerl/store/fence.py).

Real servers only: the stores are `weed mini` (S3) or local folders, the rendezvous store a
`torch.distributed.TCPStore` on 127.0.0.1 wrapped as the mesh wraps it, and node 1 is an
`Uploader` thread whose folder holds that node's files (`<base>/v<version>/`). Races are staged
by a `RemoteParts` that runs the other writer before handing over to `NodeParts`."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moerl.components.policy_update.mesh import PREFIX, NodeParts, Uploader
from moerl.config import CheckpointConfig, RunConfig
from moerl.errors import CheckpointError
from moerl.store.base import MANIFEST, MARKER, CheckpointStore, FileEntry, Manifest
from moerl.store.fence import CLAIM, Claim
from moerl.store.manifest import hash_file
from moerl.store.runs import ENGINE_EXCLUDE
from moerl.store.tiers import run_store, run_tiers
from tests.store.test_store import tree
from tests.support.objects import in_version

RUN = "r1"
CHUNK = 5 * 2**20  # checkpoint.chunk_mb = multipart_chunk_mb = 5: a multipart object is checkable
DURABLE, CACHE = "parts-durable", "parts-cache"


# -- the files of one version on two nodes ----------------------------------------------------


def _weights(path: Path, seed: int, numel: int = 64, nan: bool = False) -> None:
    t = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if nan:
        t[3] = float("nan")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": t}, str(path))


def node0(d: Path, seed: int, state: bool = False) -> Path:
    """Rank 0's node: the index, config, tokenizer and its own shard (and its trainer state)."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"seed": seed, "model_type": "mixtral"}))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (d / "tokenizer").mkdir()
    (d / "tokenizer" / "tokenizer.json").write_text(f'{{"v": {seed}}}')
    _weights(d / "model-r0-p0.safetensors", seed)
    if state:
        (d / "trainer" / "model").mkdir(parents=True)
        (d / "trainer" / "model" / "__0_0.distcp").write_bytes(os.urandom(3000))
        (d / "trainer" / "state.json").write_text('{"version": 1}')
    return d


def node1(base: Path, version: int, seed: int, big: bool = False, state: bool = False) -> Path:
    """Node 1's part of `version`, where its trainer ranks write it (`<base>/v<version>/`).
    `big`: a shard over one chunk (a multipart object, checked by its composite SHA-256)."""
    d = base / f"v{version}"
    _weights(d / "model-r1-p0.safetensors", seed + 100)
    if big:
        _weights(d / "model-r1-p1.safetensors", seed + 200, numel=CHUNK // 4 + 1000)
    if state:
        (d / "trainer" / "model").mkdir(parents=True)
        (d / "trainer" / "model" / "__1_0.distcp").write_bytes(os.urandom(5000))
        (d / "trainer" / "optim").mkdir(parents=True)
        (d / "trainer" / "optim" / "__1_0.distcp").write_bytes(os.urandom(7001))
    return d


def files(d: Path) -> set[str]:
    return {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()}


def fetched(d: Path) -> dict[str, bytes]:
    return {k: v for k, v in tree(d).items() if k not in (MANIFEST, MARKER)}


# -- servers and the rendezvous ---------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(s3_server):
    client = s3_server.client()
    for b in (DURABLE, CACHE):
        try:
            client.create_bucket(Bucket=b)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
    return s3_server


def _cfg(s3, tmp: Path, durable: str = "s3", cache: bool = False) -> RunConfig:
    """A run whose durable store is S3 (or a folder) and, with `cache`, whose cache tier is S3
    (its own bucket); every test its own prefix."""
    return RunConfig(
        checkpoint=CheckpointConfig(
            uri=f"s3://{DURABLE}/{tmp.name}" if durable == "s3" else str(tmp / "durable"),
            endpoint_url=s3.endpoint_url,
            region="us-east-1",
            cache_dir=str(tmp / "node-cache"),
            chunk_mb=CHUNK >> 20,
            multipart_chunk_mb=CHUNK >> 20,
            max_concurrency=2,
            cache_tier=(
                {"uri": f"s3://{CACHE}/{tmp.name}", "endpoint_url": s3.endpoint_url}
                if cache
                else {}
            ),
        )
    )


def objects(s3, bucket: str, tmp: Path, version: int) -> set[str]:
    """The keys under a version's folder, as the S3 server lists them (not through a store)."""
    prefix = f"{tmp.name}/runs/{RUN}/versions/v{version:06d}/"
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"].removeprefix(prefix) for page in pages for o in page.get("Contents", [])}


class Mesh:
    """Rank 0's view of a two-node mesh: the rendezvous store as `mesh.Control` wraps it, and
    node 1's uploader thread (started on demand, stopped at teardown)."""

    def __init__(self, tmp: Path) -> None:
        self.tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.kv = dist.PrefixStore(PREFIX, self.tcp)
        self.base = tmp / "node1"
        self.base.mkdir()
        self.uploaders: list[Uploader] = []

    def parts(self, timeout_s: float = 30.0) -> NodeParts:
        return NodeParts(self.kv, nodes=2, timeout_s=timeout_s)

    def start_uploader(self, cfg: RunConfig) -> Uploader:
        up = Uploader(cfg, RUN, self.kv, node=1, base=self.base)
        up.start()
        self.uploaders.append(up)
        return up

    def answer(self, seq: int, node: int = 1, timeout_s: float = 10.0) -> dict:
        """Node `node`'s answer to request `seq` (one no publisher collects any more)."""
        key = f"parts/done/{seq}/{node}"
        deadline = time.monotonic() + timeout_s
        while not self.kv.check([key]):
            assert time.monotonic() < deadline, f"node {node} never answered request {seq}"
            time.sleep(0.05)
        return json.loads(self.kv.get(key))

    def close(self) -> None:
        for up in self.uploaders:
            up.stop_event.set()
        for up in self.uploaders:
            up.join(timeout=5)
            assert not up.is_alive()


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Mesh]:
    m = Mesh(tmp_path)
    try:
        yield m
    finally:
        m.close()


class Staged:
    """`RemoteParts` that runs `before` (another writer, for real, against the same store) once
    rank 0's publisher has claimed the version and put its own files, then hands over to the
    mesh's `NodeParts`, then runs `after` (a look at the store once every node answered).
    Records the claim and stage the publisher handed over."""

    def __init__(
        self,
        parts: NodeParts,
        before: Callable[[], None],
        after: Callable[[], None] = lambda: None,
    ) -> None:
        self.parts, self.before, self.after = parts, before, after
        self.claim: Claim | None = None
        self.stage = ""

    def put(
        self,
        store: CheckpointStore,
        version: int,
        stage: str,
        claim: Claim | None,
        manifest: Manifest | None,
        chunk_size: int,
    ) -> list[FileEntry]:
        self.claim, self.stage = claim, stage
        self.before()
        out = self.parts.put(store, version, stage, claim, manifest, chunk_size)
        self.after()
        return out


# -- 1. both nodes' files in one version, in both tiers ---------------------------------------


@pytest.mark.parametrize("durable", ["s3", "folder"])
def test_a_version_holds_every_nodes_files_in_both_tiers(
    s3, mesh: Mesh, tmp_path: Path, durable: str
) -> None:
    """Rank 0's publisher publishes its folder with `parts=NodeParts`; node 1's uploader puts its
    files into the same stage under the same claim. The manifest lists both nodes' files, each
    hashed as it was read; every object is checked against it (by its SHA-256 on S3, node 1's
    multipart shard too); a fetch verifies every file. The second tier (the durable store, S3 or
    a folder with its private staging folder) is published under the same manifest, node 1
    putting its files again (size-checked against the manifest)."""
    cfg = _cfg(s3, tmp_path, durable=durable, cache=True)
    mesh.start_uploader(cfg)
    tiers = run_tiers(cfg.checkpoint, RUN, epoch=1)
    local = node0(tmp_path / "node0", seed=1)
    theirs = node1(mesh.base, 1, seed=1, big=True)
    parts = mesh.parts()

    m = tiers.publish_servable(1, local, {"note": "x"}, exclusive=True, parts=parts)
    assert tiers.cache_failed is None and tiers.cache.latest() == 1
    assert tiers.durable.latest() is None  # servable, not yet durable
    listed = {e.path: e for e in m.files}
    assert set(listed) == files(local) | files(theirs)
    for d in (local, theirs):
        for rel in files(d):
            assert listed[rel] == FileEntry(rel, *hash_file(d / rel, CHUNK))
    assert len(listed["model-r1-p1.safetensors"].chunks) == 2
    # every object, node 1's included, checked by the hash the S3 server reports
    assert tiers.cache.hash_checked == len(m.files)
    assert m.objects  # the S3 cache tier published first: the version's own object folder
    assert objects(s3, CACHE, tmp_path, 1) == in_version(m, listed) | {MANIFEST, CLAIM}
    got = tiers.cache.fetch(1, tmp_path / "from-cache", expect_sha256=m.sha256())
    assert fetched(got) == tree(local) | tree(theirs)

    # the second tier: the same manifest, node 1 asked again
    assert tiers.publish_durable(m, local, exclusive=True, parts=parts) is m
    assert tiers.durable.latest() == 1 and tiers.durable.manifest(1).sha256() == m.sha256()
    if durable == "s3":
        assert tiers.durable.hash_checked == len(m.files)
        assert objects(s3, DURABLE, tmp_path, 1) == in_version(m, listed) | {MANIFEST, CLAIM}
    else:  # the private staging folder node 1 put into was renamed into place
        versions = tmp_path / "durable" / "runs" / RUN / "versions"
        assert sorted(p.name for p in versions.iterdir()) == ["v000001"]
    got = tiers.durable.fetch(1, tmp_path / "from-durable", expect_sha256=m.sha256())
    assert fetched(got) == tree(local) | tree(theirs)
    assert parts.seq == 2 and mesh.uploaders[0].is_alive()


# -- 2-4. a failed part fails the version, and leaves nothing ---------------------------------


def _published_v0(cfg: RunConfig, tmp: Path) -> CheckpointStore:
    store = run_store(cfg.checkpoint, RUN)
    store.publish(0, node0(tmp / "v0", seed=0), exclusive=True, epoch=1)
    return store


def test_a_path_on_two_nodes_fails_the_version_naming_it(s3, mesh: Mesh, tmp_path: Path) -> None:
    """Node 1 holds a file rank 0's folder holds too: the publication fails naming it (two
    writers of one object: which bytes are stored is a race), `latest` stays, and every object
    of the version, the claim last, is deleted. The mesh's requests stay in step: once the
    folders are right, the next publication of the version succeeds."""
    cfg = _cfg(s3, tmp_path)
    mesh.start_uploader(cfg)
    store = _published_v0(cfg, tmp_path)
    local = node0(tmp_path / "node0", seed=1)
    theirs = node1(mesh.base, 1, seed=1)
    _weights(theirs / "model-r0-p0.safetensors", seed=9)  # rank 0's shard, on node 1 too
    parts = mesh.parts()
    with pytest.raises(CheckpointError, match=r"\['model-r0-p0.safetensors'\] were put by two"):
        store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=parts)
    assert store.latest() == 0 and store.versions() == [0]
    assert objects(s3, DURABLE, tmp_path, 1) == set()

    (theirs / "model-r0-p0.safetensors").unlink()
    m = store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=parts)
    assert store.latest() == 1 and {e.path for e in m.files} == files(local) | files(theirs)
    assert fetched(store.fetch(1, tmp_path / "check")) == tree(local) | tree(theirs)


def test_a_node_that_answers_an_error_fails_the_version(s3, mesh: Mesh, tmp_path: Path) -> None:
    """Node 1's shard holds a NaN: its uploader refuses it (`check_finite`) before a byte is
    uploaded and answers the error; the publication fails naming node 1 and the tensor, `latest`
    stays, and what rank 0 had put is deleted."""
    cfg = _cfg(s3, tmp_path)
    mesh.start_uploader(cfg)
    store = _published_v0(cfg, tmp_path)
    local = node0(tmp_path / "node0", seed=1)
    theirs = node1(mesh.base, 1, seed=1)
    _weights(theirs / "model-r1-p0.safetensors", seed=3, nan=True)
    with pytest.raises(CheckpointError, match=r"node 1 could not put") as e:
        store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=mesh.parts())
    assert "model-r1-p0.safetensors tensor 'w' holds 1 non-finite" in str(e.value)
    assert store.latest() == 0 and store.versions() == [0]
    assert objects(s3, DURABLE, tmp_path, 1) == set()
    assert mesh.uploaders[0].is_alive()  # the node goes on serving


def test_a_node_that_never_answers_fails_the_version_in_time(
    s3, mesh: Mesh, tmp_path: Path
) -> None:
    """No uploader on node 1: the publication fails within `NodeParts`' timeout naming node 1,
    and leaves nothing. An uploader that starts late serves the stale request, and is refused by
    the claim the failed publication deleted: it puts nothing."""
    cfg = _cfg(s3, tmp_path)
    store = _published_v0(cfg, tmp_path)
    local = node0(tmp_path / "node0", seed=1)
    theirs = node1(mesh.base, 1, seed=1)
    parts = mesh.parts(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(CheckpointError, match=r"nodes \[1\] did not put their files .* within 1 s"):
        store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=parts)
    assert 1.0 <= time.monotonic() - t0 < 10.0
    assert store.latest() == 0 and objects(s3, DURABLE, tmp_path, 1) == set()

    mesh.start_uploader(cfg)
    late = mesh.answer(1)
    assert "claim (epoch 1) was removed" in late["error"]
    assert objects(s3, DURABLE, tmp_path, 1) == set()
    # the next request reaches the running node: the version is published whole
    parts.timeout_s = 30.0
    m = store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=parts)
    assert {e.path for e in m.files} == files(local) | files(theirs)
    assert fetched(store.fetch(1, tmp_path / "check")) == tree(local) | tree(theirs)


# -- 5. fencing: a replaced mesh's node is refused ---------------------------------------------


def test_a_replaced_meshs_node_is_refused_and_the_new_version_stands(
    s3, mesh: Mesh, tmp_path: Path
) -> None:
    """Mesh A (epoch 1) claims version 1 and puts rank 0's files; before its node 1 puts its
    part, trainer B (epoch 2) recovers the store (fencing it, removing A's claim and files) and
    publishes version 1 whole from one node, with files at the same paths as A's, other bytes.
    A's node 1 is then refused naming both epochs, before it writes anything: B's version
    verifies byte for byte, and nothing of A's (its extra file) is in the store. A direct
    `put_parts` with A's claim is refused the same way. Version 2: B's claim is removed by a
    newer recovery (epoch 3) while B's node 1 is still to put: refused, nothing written."""
    cfg = _cfg(s3, tmp_path)
    mesh.start_uploader(cfg)
    a = run_tiers(cfg.checkpoint, RUN, epoch=1).durable
    b = run_tiers(cfg.checkpoint, RUN, epoch=2).durable
    local_a = node0(tmp_path / "a0", seed=1)
    theirs_a = node1(mesh.base, 1, seed=1)
    (theirs_a / "extra-r1.bin").write_bytes(os.urandom(4096))
    # B: one node holding everything; same paths and sizes as A's where A has them
    local_b = node0(tmp_path / "b0", seed=2)
    _weights(local_b / "model-r1-p0.safetensors", seed=202)
    assert (local_b / "model-r1-p0.safetensors").stat().st_size == (
        theirs_a / "model-r1-p0.safetensors"
    ).stat().st_size

    def b_takes_over() -> None:
        assert b.recover(epoch=2) is None
        assert objects(s3, DURABLE, tmp_path, 1) == set()  # A's claim and files removed
        b.publish(1, local_b, exclusive=True, chunk_size=CHUNK, epoch=2)

    parts = mesh.parts()  # one per mesh, as rank 0's `Leader` holds it: requests are numbered
    staged = Staged(parts, b_takes_over)
    with pytest.raises(CheckpointError, match=r"node 1 could not put") as e:
        a.publish(1, local_a, exclusive=True, chunk_size=CHUNK, epoch=1, parts=staged)
    assert "epoch 1 is older than epoch 2" in str(e.value)
    assert staged.claim is not None and staged.claim.epoch == 1
    assert b.latest() == 1 and b.latest_epoch() == 2 and b.read_claim(1).epoch == 2
    stored = objects(s3, DURABLE, tmp_path, 1)
    # A's failed publish left B's alone
    assert stored == in_version(b.manifest(1), files(local_b)) | {MANIFEST, CLAIM}
    assert fetched(b.fetch(1, tmp_path / "check-b")) == tree(local_b)
    # A's node called directly, as a late uploader would: refused before its first file
    with pytest.raises(CheckpointError, match=r"epoch 1 is older than epoch 2"):
        a.put_parts(1, staged.stage, theirs_a, staged.claim, None, CHUNK)
    assert objects(s3, DURABLE, tmp_path, 1) == stored
    assert fetched(b.fetch(1, tmp_path / "check-b2")) == tree(local_b)

    # version 2: B's own claim removed (a newer trainer's recovery) before its node 1 puts
    local_b2 = node0(tmp_path / "b2", seed=3)
    node1(mesh.base, 2, seed=3)
    c = run_tiers(cfg.checkpoint, RUN, epoch=3).durable
    staged2 = Staged(parts, lambda: c.recover(epoch=3))
    with pytest.raises(CheckpointError, match=r"node 1 could not put") as e:
        b.publish(2, local_b2, exclusive=True, chunk_size=CHUNK, epoch=2, parts=staged2)
    assert "claim (epoch 2) was removed" in str(e.value)
    assert objects(s3, DURABLE, tmp_path, 2) == set()
    assert c.latest() == 1 and c.latest_epoch() == 3 and c.versions() == [1]
    with pytest.raises(CheckpointError, match=r"claim \(epoch 2\) was removed"):
        b.put_parts(2, staged2.stage, mesh.base / "v2", staged2.claim, None, CHUNK)
    assert objects(s3, DURABLE, tmp_path, 2) == set()


# -- 6. the cache tier: node 1's trainer state listed, not stored -----------------------------


def test_node_state_is_listed_in_the_cache_tier_but_stored_only_durably(
    s3, mesh: Mesh, tmp_path: Path
) -> None:
    """On the cache tier (`absent=("trainer/",)`) node 1's `trainer/` shards are hashed and
    listed in the manifest but not uploaded; its engine shard is. The durable copy, under the
    same manifest, holds every node's state, and a full fetch verifies it."""
    cfg = _cfg(s3, tmp_path, cache=True)
    mesh.start_uploader(cfg)
    tiers = run_tiers(cfg.checkpoint, RUN, epoch=1)
    assert tiers.cache.absent == ENGINE_EXCLUDE == ("trainer/",)
    local = node0(tmp_path / "node0", seed=1, state=True)
    theirs = node1(mesh.base, 1, seed=1, state=True)
    parts = mesh.parts()

    m = tiers.publish_servable(1, local, {}, exclusive=True, parts=parts)
    assert tiers.cache_failed is None and tiers.cache.latest() == 1
    listed = {e.path: e for e in m.files}
    state1 = {"trainer/model/__1_0.distcp", "trainer/optim/__1_0.distcp"}
    assert state1 <= set(listed) and set(listed) == files(local) | files(theirs)
    for rel in state1 | {"model-r1-p0.safetensors"}:
        assert listed[rel] == FileEntry(rel, *hash_file(theirs / rel, CHUNK))
    cached = objects(s3, CACHE, tmp_path, 1)
    engines = in_version(m, ["model-r1-p0.safetensors", "model-r0-p0.safetensors"])
    assert engines <= cached and not {k for k in cached if "trainer/" in k}
    engine_files = {p for p in listed if not p.startswith("trainer/")}
    assert cached == in_version(m, engine_files) | {MANIFEST, CLAIM}
    engine = tiers.cache.fetch(1, tmp_path / "engine", exclude=ENGINE_EXCLUDE)
    assert fetched(engine) == {
        k: v for k, v in (tree(local) | tree(theirs)).items() if not k.startswith("trainer/")
    }

    tiers.publish_durable(m, local, exclusive=True, parts=parts)
    assert objects(s3, DURABLE, tmp_path, 1) == in_version(m, listed) | {MANIFEST, CLAIM}
    whole = tiers.durable.fetch(1, tmp_path / "whole", expect_sha256=m.sha256())
    assert fetched(whole) == tree(local) | tree(theirs)


# -- names the store reserves ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "name"),
    [
        ("node0", MANIFEST),
        ("node1", MANIFEST),
        ("node1", CLAIM),
        ("node0", CLAIM),
    ],
)
def test_a_file_named_as_the_store_reserves_is_refused_on_every_node(
    s3, mesh: Mesh, tmp_path: Path, where: str, name: str
) -> None:
    """A file in either node's folder named like the version's manifest or claim would be stored
    under that very key: it must be refused naming it, before the version ever looks complete
    (`versions()` lists a version by its manifest key) and leaving nothing behind."""
    cfg = _cfg(s3, tmp_path)
    mesh.start_uploader(cfg)
    store = _published_v0(cfg, tmp_path)
    local = node0(tmp_path / "node0", seed=1)
    theirs = node1(mesh.base, 1, seed=1)
    ((local if where == "node0" else theirs) / name).write_text('{"stray": true}')
    seen: list[list[int]] = []
    staged = Staged(mesh.parts(), lambda: None, after=lambda: seen.append(store.versions()))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        store.publish(1, local, exclusive=True, chunk_size=CHUNK, epoch=1, parts=staged)
    assert all(v == [0] for v in seen)  # never complete meanwhile
    assert store.latest() == 0 and objects(s3, DURABLE, tmp_path, 1) == set()
