"""The async trainer as one mesh whose ranks live for the whole run: rank 0 is the controller
(`worker.run_trainer` with a `Leader`: Valkey, MLflow, the publisher); the other ranks `follow`
its commands, posted in the rendezvous store, and take part in the same collectives. Weights,
gradients and Adam's state stay in memory between versions; every rank writes its own part of
each version (`ep_train.run_version`, the restarting path's code), and nodes other than rank
0's put theirs into the store themselves (`NodeParts`, `Uploader`).

Design, faults and limits: docs/weights.md, "The async trainer's mesh".
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moerl.components.policy_update.ep_optimizer import STATE_SHARDS
from moerl.components.policy_update.ep_train import (
    Session,
    join_process_group,
    one_rank,
    run_version,
    save_version,
    train_steps,
)
from moerl.config import RunConfig, config_from_json
from moerl.errors import CheckpointError, MoerlError, StoreUnavailable, TrainingError
from moerl.launch.objects import ENV_POD_IP
from moerl.records import TrainSample
from moerl.store.base import CheckpointStore
from moerl.store.fence import Claim
from moerl.store.manifest import FileEntry, Manifest

log = logging.getLogger(__name__)

PREFIX = "moerl/mesh/"
BEAT_S = 2.0  # rank 0's heartbeat period
QUIET_S = 120.0  # a follower fails after this long without rank 0's heartbeat moving
POLL_S = 0.25  # a follower polls the store for the next command this often


@dataclass(frozen=True)
class Command:
    """What rank 0 asks of every rank. `op`: fetch (each node lays published `version` out),
    load (the state in `path`, published version `version`; the run continues from version `at`), train (the next version into `path`, with
    the trainer's state when `state`), step (`trainer.schedule.stream`: minibatch `index` of the version
    trained from `version`, one optimizer step), save (`trainer.schedule.stream`: that version's files
    into `path`), send (`rollout.weight_sync` collective: the version saved last, over the wire to the
    engines: `Mesh.send_weights`), catchup (the share kept from a session, to engines that
    started after it: `Mesh.send_kept`), stop (the run is done), abort (rank 0 failed: every rank exits
    non-zero)."""

    op: str
    seq: int
    version: int = 0
    path: str = ""
    reason: str = ""
    state: bool = True  # train: write the trainer's state with this version
    at: int = 0  # load: the version the run continues from (its counters' version)
    code: int = 0  # abort: rank 0's exit code
    index: int = 0  # step: the minibatch's place in its version
    pi_old: str = ""  # step: engine | proximal (ep_train.train_ep)
    # send (rollout.weight_sync collective): the saved version over the wire, session `sha` of
    # trainer `epoch`, to `ranks` engine ranks, bounded by `timeout_s`
    sha: str = ""
    epoch: int = 0
    ranks: int = 0
    timeout_s: float = 0.0


class Control:
    """Commands from rank 0 to every rank through the rendezvous store, with rank 0's heartbeat.
    Keys are numbered, so a command is read once by each rank; each is deleted by rank 0 once
    every rank has taken it (bounded store)."""

    def __init__(self, store, rank: int, world: int, quiet_s: float = QUIET_S) -> None:
        self.store = dist.PrefixStore(PREFIX, store)
        self.rank, self.world, self.quiet_s = rank, world, quiet_s
        self.seq = 0
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def start_heartbeat(self) -> None:
        def beat() -> None:
            errors = 0
            while not self._stop.wait(BEAT_S):
                try:
                    self.store.add("beat", 1)
                    errors = 0
                except Exception as err:  # noqa: BLE001 - a blip, or the store is gone
                    errors += 1  # the followers fail after QUIET_S without a beat
                    log.warning(
                        "rank 0's heartbeat could not reach the store (%d): %s", errors, err
                    )

        self._beat = threading.Thread(target=beat, name="moerl-mesh-beat", daemon=True)
        self._beat.start()

    def fail(self, reason: str, code: int) -> None:
        """Tell every rank this one failed (a key that stays set): their watchers end them within
        BEAT_S, instead of leaving them in a collective until its timeout."""
        try:
            if self.store.add("failed", 1) == 1:  # the first failure names the cause
                self.store.set(
                    "failure", json.dumps({"rank": self.rank, "reason": reason[:500], "code": code})
                )
        except Exception as err:  # noqa: BLE001 - the store is gone: the others lose it too
            log.error("could not tell the other ranks of this failure: %s", err)

    def start_watch(self) -> None:
        """End this process when another rank has failed (`fail`), with that rank's exit code:
        a rank in a collective with a failed peer would otherwise wait for the timeout."""

        def watch() -> None:
            while not self._stop.wait(BEAT_S):
                try:
                    failed = self.store.check(["failure"])
                    info = json.loads(self.store.get("failure")) if failed else None
                except Exception:  # noqa: BLE001 - the store is gone: receive() names it
                    continue
                if info is not None and info["rank"] != self.rank:
                    log.error(
                        "trainer rank %d failed (%s); rank %d stops with it",
                        info["rank"],
                        info["reason"],
                        self.rank,
                    )
                    logging.shutdown()
                    os._exit(int(info["code"]) or 1)

        threading.Thread(target=watch, name="moerl-mesh-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def send(self, op: str, **fields: Any) -> Command:
        self.seq += 1
        cmd = Command(op, self.seq, **fields)
        self.store.set(f"cmd/{cmd.seq}", json.dumps(asdict(cmd)))
        # every rank took the one before the previous (it took part in the previous one's
        # collectives, or, after a `fetch`, which has none, in the `load` that follows it)
        if cmd.seq > 2 and op != "abort":
            self.store.delete_key(f"cmd/{cmd.seq - 2}")
        return cmd

    def receive(self, waiting_on: str) -> Command:
        """The next command. Fails if rank 0's heartbeat does not move for `quiet_s` (a dead or
        hung controller), naming what this rank waited on."""
        self.seq += 1
        key = f"cmd/{self.seq}"
        beat, moved_at = self.store.add("beat", 0), time.monotonic()
        # polled, not a blocking wait: a store's wait timeout logs a warning every time
        while True:
            try:
                if self.store.check([key]):
                    break
                now_beat = self.store.add("beat", 0)
            except RuntimeError as err:  # the store is gone: rank 0's node went away
                raise TrainingError(
                    f"trainer rank {self.rank}: lost the rendezvous store while waiting on "
                    f"{waiting_on}: {err}"
                ) from None
            if now_beat != beat:
                beat, moved_at = now_beat, time.monotonic()
            elif time.monotonic() - moved_at > self.quiet_s:
                raise TrainingError(
                    f"trainer rank {self.rank}: no word from rank 0 for {self.quiet_s:.0f} s "
                    f"(its heartbeat stopped) while waiting on {waiting_on}"
                )
            time.sleep(POLL_S)
        return Command(**json.loads(self.store.get(key)))


def _entries_json(version: int, entries: list[FileEntry], chunk_size: int) -> str:
    """Entries as a manifest's JSON (which checks their chunks against `chunk_size`)."""
    return Manifest(version, tuple(entries), "", {}, chunk_size).to_json()


class NodeParts:
    """The version files the mesh's other nodes hold (`RemoteParts`): rank 0's publisher posts
    what to put where (the store, the stage, the claim; the manifest for a second tier), each
    other node's uploader puts its node's files and posts their entries. Waits at most
    `timeout_s`, then fails naming the nodes that did not answer."""

    def __init__(self, kv, nodes: int, timeout_s: float, quiet_s: float = QUIET_S) -> None:
        self.kv, self.nodes, self.timeout_s, self.quiet_s = kv, nodes, timeout_s, quiet_s
        self.seq = 0  # the publisher thread's only

    def _alive(self, node: int) -> int:
        """Node `node`'s uploader beat count (0 before its first beat)."""
        return int(self.kv.add(f"parts/alive/{node}", 0))

    def put(
        self,
        store: CheckpointStore,
        version: int,
        stage: str,
        claim: Claim | None,
        manifest: Manifest | None,
        chunk_size: int,
    ) -> list[FileEntry]:
        self.seq += 1
        req = {
            "version": version,
            "store": store.uri,
            "stage": stage,
            "claim": None if claim is None else claim.to_json(),
            "manifest": None if manifest is None else manifest.to_json(),
            "chunk_size": chunk_size,
        }
        self.kv.set(f"parts/req/{self.seq}", json.dumps(req))
        deadline = time.monotonic() + self.timeout_s
        out: list[FileEntry] = []
        waiting = set(range(1, self.nodes))
        beats = {n: (self._alive(n), time.monotonic()) for n in waiting}
        while waiting:
            for node in sorted(waiting):  # a node whose uploader stopped beating: fail now
                beat, since = beats[node]
                if (now := self._alive(node)) != beat:
                    beats[node] = (now, time.monotonic())
                elif time.monotonic() - since > self.quiet_s:
                    raise CheckpointError(
                        f"version {version}: node {node}'s uploader has been silent for "
                        f"{self.quiet_s:.0f} s (dead, or its store unreachable)"
                    )
            for node in sorted(waiting):
                key = f"parts/done/{self.seq}/{node}"
                if not self.kv.check([key]):
                    continue
                answer = json.loads(self.kv.get(key))
                self.kv.delete_key(key)
                waiting.discard(node)
                if "error" in answer:
                    raise (StoreUnavailable if answer.get("unavailable") else CheckpointError)(
                        f"version {version}: node {node} could not put its files into "
                        f"{store.uri}: {answer['error']}"
                    )
                out += Manifest.from_json(answer["entries"]).files
            if waiting and time.monotonic() > deadline:
                raise CheckpointError(
                    f"version {version}: nodes {sorted(waiting)} did not put their files into "
                    f"{store.uri} within {self.timeout_s:.0f} s"
                )
            if waiting:
                time.sleep(POLL_S)
        self.kv.delete_key(f"parts/req/{self.seq}")
        return out


class Uploader(threading.Thread):
    """A node's side of `NodeParts` (its first rank): put this node's files of each version
    rank 0's publisher asks for, checked finite first, into the store named; keep the newest
    folders a publication may still need and delete older ones."""

    def __init__(self, cfg: RunConfig, run_id: str, kv, node: int, base: Path) -> None:
        super().__init__(name="moerl-mesh-uploader", daemon=True)
        self.cfg, self.run_id, self.kv, self.node, self.base = cfg, run_id, kv, node, base
        self.stop_event = threading.Event()

    def _store(self, uri: str) -> CheckpointStore:
        from moerl.store.tiers import run_tiers

        tiers = run_tiers(self.cfg.checkpoint, self.run_id)
        for st in (tiers.cache, tiers.durable):
            if st is not None and st.uri == uri:
                return st
        raise CheckpointError(f"no tier of this run is {uri}")

    def _serve(self, req: dict) -> str:
        from moerl.components.publish_checkpoint.stage import check_finite

        version = req["version"]
        src = self.base / f"v{version}"
        manifest = None if req["manifest"] is None else Manifest.from_json(req["manifest"])
        if manifest is None and src.is_dir():
            check_finite(src, version)
        store = self._store(req["store"])
        entries = store.put_parts(
            version,
            req["stage"],
            src,
            None if req["claim"] is None else Claim.from_json(req["claim"]),
            manifest,
            req["chunk_size"],
        )
        # the folders a publication in flight may still ask for; older ones are done
        keep = self.cfg.checkpoint.max_unpublished + 1
        for old in self.base.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - keep:
                shutil.rmtree(old, ignore_errors=True)
        return _entries_json(
            version, entries, manifest.chunk_size if manifest is not None else req["chunk_size"]
        )

    def _beat(self) -> None:
        """This node's uploader is alive (rank 0's `NodeParts` fails a node whose beat stops),
        also while a long put runs."""
        while not self.stop_event.wait(BEAT_S):
            try:
                self.kv.add(f"parts/alive/{self.node}", 1)
            except Exception as err:  # noqa: BLE001 - a blip; a lasting loss fails the node
                log.warning(
                    "node %d: the uploader's beat could not reach the store: %s", self.node, err
                )

    def run(self) -> None:
        threading.Thread(target=self._beat, name="moerl-mesh-uploader-beat", daemon=True).start()
        seq, errors = 1, 0
        while not self.stop_event.is_set():
            try:
                if not self.kv.check([f"parts/req/{seq}"]):
                    self.stop_event.wait(POLL_S)
                    continue
                req = json.loads(self.kv.get(f"parts/req/{seq}"))
                errors = 0
            except Exception as err:  # noqa: BLE001 - a blip, or the store is gone
                errors += 1
                if errors > 10:  # the mesh is ending (or its store is): `follow` sees us stop
                    log.error("node %d: the uploader lost the store: %s", self.node, err)
                    return
                self.stop_event.wait(1.0)
                continue
            try:
                answer: dict[str, str | bool] = {"entries": self._serve(req)}
            except Exception as err:  # noqa: BLE001 - handed to rank 0's publisher, which raises
                log.error("node %d: version %s parts failed: %s", self.node, req["version"], err)
                # a store away (a brownout) is marked: rank 0's publisher waits and asks again
                answer = {
                    "error": f"{type(err).__name__}: {str(err)[:500]}",
                    "unavailable": isinstance(err, StoreUnavailable),
                }
            try:
                self.kv.set(f"parts/done/{seq}/{self.node}", json.dumps(answer))
            except Exception as err:  # noqa: BLE001 - rank 0 then fails this node by its timeout
                log.error(
                    "node %d: could not answer version %s: %s", self.node, req["version"], err
                )
                return
            seq += 1


def _batch(samples: list[TrainSample] | None) -> list[TrainSample]:
    """The version's batch from rank 0 to every rank: one broadcast."""
    box: list[Any] = [[s.model_dump(mode="json") for s in samples] if samples is not None else None]
    dist.broadcast_object_list(box, src=0)
    return [TrainSample.model_validate(s) for s in box[0]]


def newest_with_state(store: CheckpointStore, latest: int) -> int:
    """The newest durable version at or below `latest` whose manifest carries the trainer's
    state (Adam's: `trainer/optimizer/` a mesh wrote, or `trainer/optimizer.pt` the single
    process did), or version 0 (the initial policy, whose state is fresh)."""
    for v in range(latest, 0, -1):
        try:
            files = store.manifest(v).files
        except CheckpointError:  # pruned by retention (state_every <= keep_last keeps one)
            continue
        if any(f.path.startswith("trainer/optimizer") for f in files):
            return v
    return 0


def _node() -> tuple[int, int]:
    """(this rank's node, its local rank): torchrun's GROUP_RANK, else one node."""
    return int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))


def _nodes() -> int:
    """Nodes in the mesh: every node runs LOCAL_WORLD_SIZE ranks."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return max(1, int(os.environ.get("WORLD_SIZE", "1")) // max(local, 1))


def node_dir(run_id: str, node: int) -> Path:
    """Where a node other than 0 keeps its copy of the state and its part of each version."""
    return Path(tempfile.gettempdir()) / f"moerl-mesh-{run_id}-node{node}"


class Mesh:
    """What every rank holds: the session (model, optimizer, counters) once loaded."""

    def __init__(self, cfg: RunConfig, control: Control, run_id: str) -> None:
        self.cfg, self.control, self.run_id = cfg, control, run_id
        self.session: Session | None = None
        self.loads = 0
        # (version, sha, epoch) -> this rank's share as sent, of the last two weight sessions
        # (a catch-up serves the newest delivered, which the last may not be)
        self.kept: dict[tuple[int, str, int], list] = {}

    def load(self, path: Path, version: int, at: int) -> float:
        """Load published `version`, laid out in `path` without its state shards, onto this rank
        (a collective), fetching from the durable store only the shards this rank reads;
        continuing from version `at` (later than the state's own when the newest versions carry
        no state). Returns the seconds."""
        t0 = time.perf_counter()
        fetch = None
        if version > 0:  # version 0 carries no trainer state
            from moerl.store.runs import run_store

            store = run_store(self.cfg.checkpoint, self.run_id)
            manifest = store.manifest(version)

            def fetch(rel: str) -> None:
                store.fetch_file(version, rel, path / rel, manifest)

        self.session = Session.load(self.cfg, path, fetch)
        self.session.counters.version = at
        self.loads += 1
        return time.perf_counter() - t0

    def train(
        self, samples: list[TrainSample] | None, version: int, out: Path, with_state: bool
    ) -> dict:
        if self.session is None:
            raise TrainingError("trainer mesh: a version was asked for before any state loaded")
        batch = _batch(samples)
        return run_version(self.cfg, self.session, batch, version, out, with_state)

    def step(
        self, samples: list[TrainSample] | None, version: int, index: int, pi_old: str
    ) -> dict:
        """`trainer.schedule.stream`: one minibatch of the version trained from `version`, one step."""
        if self.session is None:
            raise TrainingError("trainer mesh: a minibatch was sent before any state loaded")
        # a seed per (version, minibatch): the same on every rank, never repeated in a run
        seed = self.cfg.trainer.seed + version * 100_003 + index
        return train_steps(self.cfg, self.session, _batch(samples), seed, pi_old=pi_old)

    def send_weights(
        self, cmd: Command, on_addresses: Callable[[], object] | None = None
    ) -> dict[str, Any]:
        """`send`: this rank's share of the version it holds, straight to every engine rank over
        its own group (ep_send.WeightSender), cast to the serving dtype. Each rank hosts its
        group's rendezvous on its own host (`MOERL_POD_IP` on a cluster) and posts the address
        in the mesh's store; rank 0 then opens the session (`on_addresses`). A group that does
        not form or fails costs only the session (the engines take the version from files):
        every rank still takes its part in the share's gathers, and the run goes on. The share
        as sent is kept in host memory for catch-ups (`send_kept`)."""
        import torch

        from moerl.components.redistribute_weights import wire

        if self.session is None:
            raise TrainingError("trainer mesh: weights were sent before any state loaded")
        sender, why = self._group(cmd, on_addresses)
        _fault(self.control.rank, cmd.version, op="send")
        s = self.session
        kept: list = []
        stats, failed = sender.send_in_step(
            s.model,
            s.ep_blocks,
            s.layout,
            s.mesh,
            wire.Session(cmd.version, cmd.sha, cmd.epoch),
            getattr(torch, self.cfg.rollout.resolved.dtype),
            deadline_s=cmd.timeout_s,
            keep=kept,
        )
        self.kept = {k: v for k, v in self.kept.items() if k[0] == cmd.version - 1}
        self.kept[(cmd.version, cmd.sha, cmd.epoch)] = kept
        return self._sent(cmd, sender, stats, why or failed)

    def send_kept(
        self, cmd: Command, on_addresses: Callable[[], object] | None = None
    ) -> dict[str, Any]:
        """`catchup`: the share kept from version `cmd.version`'s session, to the engines that
        started after it (no collective over the mesh)."""
        from moerl.components.redistribute_weights import wire

        sender, why = self._group(cmd, on_addresses)
        stats, share = None, self.kept.get((cmd.version, cmd.sha, cmd.epoch))
        if not why and share is None:
            why = f"this rank kept no share of version {cmd.version}"
        if not why and share is not None:
            session = wire.Session(cmd.version, cmd.sha, cmd.epoch)
            stats, why = sender.send_kept(session, share, deadline_s=cmd.timeout_s)
        return self._sent(cmd, sender, stats, why)

    def _group(self, cmd: Command, on_addresses: Callable[[], object] | None):
        """This rank's group for `cmd`'s session: its address posted, rank 0's `on_addresses`
        run (it opens the session), joined. (sender, why it failed or "")."""
        from moerl.components.policy_update.ep_send import WeightSender
        from moerl.components.redistribute_weights import wire

        host = os.environ.get(ENV_POD_IP) or "127.0.0.1"
        address = wire.GroupAddress(host, wire.free_port(host), 1 + cmd.ranks)
        self.control.store.set(_address_key(cmd, self.control.rank), json.dumps(address.as_dict()))
        device = "cuda" if self.cfg.trainer.parallelism.device == "cuda" else "cpu"
        sender = WeightSender(address, device, cmd.timeout_s)
        try:
            if on_addresses is not None:
                on_addresses()
            sender.join()
        except Exception as err:  # noqa: BLE001 - the session fails; the run goes on
            return sender, f"{type(err).__name__}: {err}"
        return sender, ""

    def _sent(self, cmd: Command, sender, stats, why: str) -> dict[str, Any]:
        sender.close()
        if why:
            log.warning(
                "rank %d: version %d not sent (%s): %s", self.control.rank, cmd.version, cmd.op, why
            )
        return {
            "rank": self.control.rank,
            "sent": stats.bytes if stats else 0,
            "seconds": stats.seconds if stats else 0.0,
            "error": why,
        }

    def addresses(self, cmd: Command) -> list[dict[str, Any]]:
        """Every rank's group address for `cmd`'s session, in rank order, once all are posted
        (bounded by the session's timeout)."""
        keys = [_address_key(cmd, r) for r in range(self.control.world)]
        deadline = time.monotonic() + cmd.timeout_s
        while not self.control.store.check(keys):
            if time.monotonic() > deadline:
                raise TrainingError(
                    f"trainer mesh: not every rank posted its weight group for version "
                    f"{cmd.version} within {cmd.timeout_s:.0f} s"
                )
            time.sleep(POLL_S / 5)
        return [json.loads(self.control.store.get(k)) for k in keys]

    def save(self, out: Path, with_state: bool) -> dict:
        """`trainer.schedule.stream`: the version its minibatches trained, written (every rank its part)."""
        if self.session is None:
            raise TrainingError("trainer mesh: a version was saved before any state loaded")
        return save_version(self.cfg, self.session, out, with_state)


class Leader(Mesh):
    """Rank 0's side: what `worker.run_trainer` calls. Every call is a command to all ranks."""

    def __init__(
        self, cfg: RunConfig, control: Control, run_id: str, nodes: int | None = None
    ) -> None:
        super().__init__(cfg, control, run_id)
        control.start_heartbeat()
        self.started = time.time()
        self.nodes = nodes = _nodes() if nodes is None else nodes
        # each version's files on the other nodes: put into the store by those nodes
        self.parts: NodeParts | None = (
            NodeParts(control.store, nodes, cfg.checkpoint.claim_ttl_s) if nodes > 1 else None
        )

    def load_state(
        self, path: Path, version: int, at: int, prepare: Callable[[], object]
    ) -> dict[str, float]:
        """Every rank loads published `version`; the run continues from version `at`. First
        every node lays the version out in parallel (`prepare` here, into `path`; `fetch` on the
        others), and only once all have, bounded by `checkpoint.claim_ttl_s`, do the ranks meet
        in the load's collectives: no collective waits on a download."""
        t0 = time.perf_counter()
        self.control.send("fetch", version=version)
        prepare()
        waiting, deadline = (
            set(range(1, self.nodes)),
            time.monotonic() + self.cfg.checkpoint.claim_ttl_s,
        )
        while waiting:
            waiting = {
                n for n in waiting if not self.control.store.check([f"node/{n}/ready/{version}"])
            }
            if waiting and time.monotonic() > deadline:
                raise TrainingError(
                    f"trainer mesh: nodes {sorted(waiting)} did not lay out version {version} within "
                    f"{self.cfg.checkpoint.claim_ttl_s:.0f} s (checkpoint.claim_ttl_s)"
                )
            if waiting:
                time.sleep(POLL_S)
        fetched = time.perf_counter() - t0
        self.control.send("load", version=version, path=str(path), at=at)
        return {
            "timing/trainer_fetch_s": fetched,
            "timing/trainer_load_s": self.load(path, version, at),
        }

    def with_state(self, version: int) -> bool:
        """Whether the version trained from `version` (version + 1) carries the trainer's state:
        every `checkpoint.state_every`-th, and the run's last."""
        made = version + 1
        return made % self.cfg.resolved.state_every == 0 or made >= self.cfg.pipeline.versions

    def train_version(
        self, samples: list[TrainSample], version: int, out: Path, with_state: bool = False
    ) -> dict[str, float]:
        """Train every rank on `samples`, each writing its part of version + 1 into `out` (on
        node 0; its own folder elsewhere), with the trainer's state when due (`with_state`:
        always, as the sync update needs)."""
        state = with_state or self.with_state(version)
        self.control.send("train", version=version, path=str(out), state=state)
        metrics = self.train(samples, version, out, state)
        metrics["trainer/state_saved"] = float(state)
        metrics["trainer/mesh_loads"] = float(self.loads)
        metrics["trainer/mesh_uptime_s"] = time.time() - self.started
        return metrics

    def train_step(
        self, samples: list[TrainSample], version: int, index: int, pi_old: str
    ) -> dict[str, float]:
        """`trainer.schedule.stream`: every rank takes one optimizer step on `samples`, minibatch `index`
        of the version trained from `version`, against `pi_old` (engine | proximal); its
        weights are written by `save_version`. A minibatch with fewer samples than ranks (its
        groups had no reward variance) trains nothing and is not sent: a command whose only
        collective is the broadcast would not hold rank 0 back (NCCL returns at once), and
        `Control.send` deletes the command before the previous one, so rank 0 could delete
        a command a slow rank had not read yet."""
        if len(samples) < self.control.world:
            return {"train/steps": 0.0, "train/skipped_steps": 0.0, "train/empty_batch": 1.0}
        self.control.send("step", version=version, index=index, pi_old=pi_old)
        return self.step(samples, version, index, pi_old)

    def save_version(self, version: int, out: Path) -> dict[str, float]:
        """`trainer.schedule.stream`: every rank writes its part of version + 1, trained by the steps
        `train_step` took, into `out` (as `train_version` does after its steps)."""
        state = self.with_state(version)
        self.control.send("save", version=version, path=str(out), state=state)
        metrics = self.save(out, state)
        metrics["trainer/state_saved"] = float(state)
        metrics["trainer/mesh_loads"] = float(self.loads)
        metrics["trainer/mesh_uptime_s"] = time.time() - self.started
        return metrics

    def send_weights_all(
        self,
        version: int,
        sha: str,
        epoch: int,
        ranks: int,
        open_session: Callable[[list], object],
        catchup: int = 0,
    ) -> dict[str, Any]:
        """`rollout.weight_sync` collective: every rank sends its share of `version` (the one
        saved last) to `ranks` engine ranks; `open_session(addresses)` opens the session once
        every rank's group address is known. `catchup` n > 0: the n-th catch-up, the share kept
        from `version`'s session instead (`send_kept`). Returns this rank's result."""
        timeout_s = self.cfg.rollout.weight_sync_timeout_s
        fields = {"version": version, "sha": sha, "epoch": epoch, "ranks": ranks}
        op = "catchup" if catchup else "send"
        cmd = self.control.send(op, **fields, timeout_s=timeout_s, index=catchup)
        run = self.send_kept if catchup else self.send_weights
        return run(cmd, lambda: open_session(self.addresses(cmd)))

    def stop(self, error: BaseException | None = None) -> None:
        try:
            if error is None:
                self.control.send("stop")
            else:
                reason, code = f"{type(error).__name__}: {error}"[:500], exit_code(error)
                self.control.send("abort", reason=reason, code=code)  # ranks waiting for a command
                self.control.fail(reason, code)  # ranks inside a collective
        finally:
            self.control.close()


@contextmanager
def in_process(cfg: RunConfig, run_id: str) -> Iterator[Leader]:
    """This process as the whole mesh, one rank (`trainer.parallelism.world_size` 1): the same
    `Leader`, session, steps, export and state as on many ranks, with no other rank to command.
    Stopped (or aborted, on an error) when the block ends."""
    with one_rank(cfg) as store:
        leader = Leader(cfg, Control(store, 0, 1), run_id, nodes=1)
        try:
            yield leader
        except BaseException as err:
            leader.stop(err)
            raise
        leader.stop()


def _address_key(cmd: Command, rank: int) -> str:
    """Where `rank` posts its group's address for `cmd`'s session (a catch-up: its number)."""
    return f"wire/{cmd.op}/{cmd.epoch}/{cmd.version}/{cmd.index}/{rank}"


def _node_fetch(cfg: RunConfig, run_id: str, cmd: Command, control: Control, base: Path) -> None:
    """`fetch`: a node other than rank 0's lays out the published version once (its first
    rank; verified against the manifest, without the ranks' state shards) and says so in the
    store. Outside any collective, so a long download trips no collective's timeout."""
    node, local_rank = _node()
    if node == 0 or local_rank != 0:
        return
    from moerl.components.publish_checkpoint.stage import prepare_resume

    prepare_resume(cfg, run_id, cmd.version, _loaded(base, cmd.version), exclude=STATE_SHARDS)
    control.store.set(f"node/{node}/ready/{cmd.version}", "1")


def _loaded(base: Path, version: int) -> Path:
    return base / f"loaded-v{version}"


FAULT_ENV = "MOERL_TEST_MESH_KILL"  # tests: "RANK:VERSION:MARKER", see `_fault`


def _fault(rank: int, version: int, op: str = "train") -> None:
    """Fault tests only: with MOERL_TEST_MESH_KILL "RANK:VERSION:MARKER" set, rank RANK SIGKILLs
    itself as it starts training on version VERSION's batch (every other rank is then inside
    that version's collectives), once: the marker file records that it did. "send:RANK:..."
    instead: once it has joined its weight group for version VERSION, before sending."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    want_op, spec = ("send", spec[5:]) if spec.startswith("send:") else ("train", spec)
    want_rank, want_version, marker = spec.split(":", 2)
    if want_op != op:
        return
    if (int(want_rank), int(want_version)) != (rank, version) or Path(marker).exists():
        return
    Path(marker).write_text(f"rank {rank} killed at version {version}\n")
    log.error("test fault: rank %d kills itself at version %d", rank, version)
    os.kill(os.getpid(), signal.SIGKILL)


def follow(cfg: RunConfig, run_id: str, control: Control) -> int:
    """A rank other than 0: do what rank 0 asks until it says stop."""
    mesh = Mesh(cfg, control, run_id)
    node, local_rank = _node()
    base = node_dir(run_id, node)
    uploader = None
    if node != 0 and local_rank == 0:  # this node's files reach the store through its first rank
        shutil.rmtree(base, ignore_errors=True)  # a failed predecessor's
        base.mkdir(parents=True)
        uploader = Uploader(cfg, run_id, control.store, node, base)
        uploader.start()
    version = None
    stepped = None  # the version of the last `step` taken
    try:
        while True:
            if uploader is not None and not uploader.is_alive():
                raise TrainingError(f"trainer node {node}: its uploader thread stopped")
            what = "the state to load" if version is None else f"the batch of version {version + 1}"
            cmd = control.receive(what)
            if cmd.op == "stop":
                return 0
            if cmd.op == "abort":
                log.error("rank 0 failed (%s); stopping", cmd.reason)
                return cmd.code or 1
            if cmd.op == "load":
                path = Path(cmd.path) if node == 0 else _loaded(base, cmd.version)
                mesh.load(path, cmd.version, cmd.at)
                version = cmd.at
            elif cmd.op == "fetch":
                _node_fetch(cfg, run_id, cmd, control, base)
            elif cmd.op == "train":
                _fault(control.rank, cmd.version)
                out = Path(cmd.path)
                if node != 0:  # this node's part of the version, which its uploader puts
                    out = base / out.name
                mesh.train(None, cmd.version, out, cmd.state)
                version = cmd.version
            elif cmd.op == "step":
                if cmd.version != stepped:  # the version's first step sent (empty ones are not)
                    _fault(control.rank, cmd.version)
                    stepped = cmd.version
                mesh.step(None, cmd.version, cmd.index, cmd.pi_old)
            elif cmd.op == "send":
                mesh.send_weights(cmd)
            elif cmd.op == "catchup":
                mesh.send_kept(cmd)
            elif cmd.op == "save":
                out = Path(cmd.path)
                if node != 0:
                    out = base / out.name
                mesh.save(out, cmd.state)
                version = cmd.version
            else:
                raise TrainingError(f"trainer mesh: unknown command {cmd.op!r} from rank 0")
    except BaseException as err:
        control.fail(f"{type(err).__name__}: {err}", getattr(err, "exit_code", 1))
        raise
    finally:
        if uploader is not None:
            uploader.stop_event.set()
            uploader.join(timeout=5)
            shutil.rmtree(base, ignore_errors=True)


def exit_code(err: BaseException) -> int:
    """The trainer's exit code for `err`: a MoerlError's own (a refused config is not retried),
    1 otherwise."""
    return err.exit_code if isinstance(err, MoerlError) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--result", required=True)
    # the sync update: one version from this published one, on this batch (`update.py`)
    ap.add_argument("--policy-json")
    ap.add_argument("--batch")
    ap.add_argument("--iteration", type=int, default=0)
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s trainer rank {os.environ.get('RANK', '?')} %(levelname)s %(message)s",
    )
    cfg = config_from_json(Path(a.config_json).read_text())
    join_process_group(cfg)
    rank = dist.get_rank()
    node, local_rank = _node()
    log.info(
        "rank %d of %d (pid %d, node %d) joined the trainer mesh",
        rank,
        dist.get_world_size(),
        os.getpid(),
        node,
    )
    from torch.distributed.distributed_c10d import _get_default_store

    # the store the ranks met through: torchrun's (TCP) or the local launcher's file store
    control = Control(_get_default_store(), rank, dist.get_world_size())
    control.start_watch()
    ok = False
    try:
        if rank != 0:
            code = follow(cfg, a.run_id, control)
            ok = code == 0
            return code
        from moerl.components.policy_update.worker import run_trainer

        leader = Leader(cfg, control, a.run_id)
        try:
            if a.batch:  # the sync update's one version
                from moerl.components.policy_update.update import update_on
                from moerl.records import PolicyVersion

                made, metrics = update_on(
                    cfg,
                    a.run_id,
                    leader,
                    PolicyVersion.model_validate_json(a.policy_json),
                    a.batch,
                    a.iteration,
                )
                result = json.dumps({"policy": made.model_dump(mode="json"), "metrics": metrics})
            else:  # the async trainer, for the whole run
                result = run_trainer(cfg, a.run_id, mesh=leader).model_dump_json()
        except BaseException as err:
            # the trainer's exit code, for the launcher (which may see another rank's first)
            result_code(Path(a.result)).write_text(str(exit_code(err)))
            leader.stop(err)
            if isinstance(err, MoerlError):  # one line, no traceback
                log.error("%s", err)
                return err.exit_code
            raise
        leader.stop()
        Path(a.result).write_text(result)
        ok = True
        return 0
    finally:
        control.close()
        if ok:  # on a failure peers may be inside a collective: tearing it down could block
            dist.destroy_process_group()


def result_code(result: Path) -> Path:
    """Where rank 0 leaves its exit code when it fails (beside the result)."""
    return result.with_name(result.name + ".code")


if __name__ == "__main__":
    raise SystemExit(main())
