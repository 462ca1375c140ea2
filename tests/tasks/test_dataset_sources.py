"""`task.dataset` and `reward_model.data` from local files, folders of shards and S3 (a real
S3 server): JSONL and Parquet give the same prompts in the same order wherever they live; the
index counts bad rows per shard; a shard rewritten under a run is refused; a window reads only
the shards it needs; the MLflow dataset input records the per-shard digest."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moerl.config import CheckpointConfig, parse_config
from moerl.errors import DataError
from moerl.records import PreferencePair
from moerl.store.s3server import S3Server
from moerl.store.sources import SourceChanged
from moerl.tasks.dataset import Dataset, load_dataset
from moerl.tasks.preferences import load_preferences
from moerl.tasks.shards import digest

N = 60


def _rows(n: int = N) -> list[dict]:
    out = []
    for i in range(n):
        row: dict = {"id": f"r{i:03d}", "task": "copy" if i % 3 else "sum", "answer": str(i)}
        if i % 5 == 0:
            row["messages"] = [{"role": "user", "content": f"copy {i}"}]
            row["meta"] = {"k": i}
        else:
            row["prompt"] = f"copy {i}="
        out.append(row)
    return out


def _jsonl(rows: list[dict], extra: list[str] = ()) -> bytes:  # type: ignore[assignment]
    return ("\n".join([json.dumps(r) for r in rows] + list(extra)) + "\n").encode()


def _parquet(rows: list[dict]) -> bytes:
    """Parquet with `messages`/`meta` as JSON text (the other accepted form, structs, is
    covered by `_parquet_structs`)."""
    recs = [
        {
            "id": r["id"],
            "task": r["task"],
            "prompt": r.get("prompt"),
            "messages": json.dumps(r["messages"]) if "messages" in r else None,
            "answer": r["answer"],
            "meta": json.dumps(r["meta"]) if "meta" in r else None,
        }
        for r in rows
    ]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(recs), sink)
    return sink.getvalue().to_pybytes()


def _parquet_structs(rows: list[dict]) -> bytes:
    recs = [{"prompt": None, "messages": None, "meta": None, **r} for r in rows]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(recs), sink)
    return sink.getvalue().to_pybytes()


def _layouts(rows: list[dict]) -> dict[str, dict[str, bytes]]:
    thirds = [rows[:20], rows[20:45], rows[45:]]
    return {
        "one-jsonl": {"data.jsonl": _jsonl(rows)},
        "jsonl-shards": {f"part-{i}.jsonl": _jsonl(t) for i, t in enumerate(thirds)},
        "parquet-shards": {f"part-{i}.parquet": _parquet(t) for i, t in enumerate(thirds)},
        "mixed": {
            "a/part-0.parquet": _parquet_structs(thirds[0]),
            "a/part-1.jsonl.gz": gzip.compress(_jsonl(thirds[1])),
            "b/part-2.parquet": _parquet(thirds[2]),
            "README.txt": b"not data",
        },
    }


@pytest.fixture
def bucket(s3_server: S3Server) -> str:
    name = "data-" + hashlib.sha256(str(random.random()).encode()).hexdigest()[:10]
    s3_server.client().create_bucket(Bucket=name)
    return name


def _ck(s3: S3Server) -> CheckpointConfig:
    return CheckpointConfig(uri="s3://unused/x", endpoint_url=s3.endpoint_url)


def _put(s3: S3Server, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        s3.client().put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=data)


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


WINDOWS = [(0, 7), (5, 30), (18, 9), (55, 12), (121, 60)]


def test_the_same_rows_give_the_same_prompts_in_the_same_order_local_or_s3(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    rows = _rows()
    ck = _ck(s3_server)
    for layout, files in _layouts(rows).items():
        local = _write(tmp_path / layout, files)
        _put(s3_server, bucket, layout, files)
        spec = str(local / "data.jsonl") if layout == "one-jsonl" else str(local)
        uri = f"s3://{bucket}/{layout}/" + ("data.jsonl" if layout == "one-jsonl" else "")
        a, b = load_dataset(spec, 0.0), load_dataset(uri, 0.0, ck)
        assert a.n == b.n == N and a.bad_rows == b.bad_rows == 0
        assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
        assert [s.name for s in a.shards] == [s.name for s in b.shards]
        assert sorted(r.id for r in a.rows) == [r["id"] for r in rows]
        for seed in (0, 3):
            for start, size in WINDOWS:
                wa, wb = a.window(start, size, seed), b.window(start, size, seed)
                assert wa == wb, (layout, seed, start)
        # every prompt once per epoch, messages and meta as in the JSON rows
        epoch = b.window(0, N, 11)
        assert sorted(r.id for r in epoch) == [r["id"] for r in rows]
        got = {r.id: r.model_dump(exclude_none=True, exclude_defaults=True) for r in epoch}
        assert got == {r["id"]: r for r in rows}
        if layout == "mixed":
            assert [s.name for s in b.shards] == [
                "a/part-0.parquet",
                "a/part-1.jsonl.gz",
                "b/part-2.parquet",
            ]
    # one shard: exactly the seeded permutation of the rows (the order before shards)
    one = load_dataset(f"s3://{bucket}/one-jsonl/data.jsonl", 0.0, ck)
    order = list(range(N))
    random.Random(5).shuffle(order)
    assert [r.id for r in one.window(10, 80, 5)] == [
        rows[order[(10 + j) % N]]["id"] for j in range(80)
    ]
    # several shards: shards in a seeded order, rows of shard i by Random(seed + i)
    many = load_dataset(f"s3://{bucket}/jsonl-shards/", 0.0, ck)
    thirds = [rows[:20], rows[20:45], rows[45:]]
    shard_order = [0, 1, 2]
    random.Random(5).shuffle(shard_order)
    expect = []
    for i in shard_order:
        perm = list(range(len(thirds[i])))
        random.Random(5 + i).shuffle(perm)
        expect += [thirds[i][k]["id"] for k in perm]
    assert [r.id for r in many.window(0, N, 5)] == expect


def test_bad_rows_are_counted_per_shard_and_too_many_are_refused(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    rows = _rows()
    bad_parquet = _parquet_structs(
        rows[20:40]
        + [
            {"id": "x1", "task": "t", "answer": None, "prompt": "p"},  # null answer
            {"id": "x2", "task": "t", "answer": "1"},  # neither prompt nor messages
        ]
    )
    files = {
        "p0.jsonl": _jsonl(rows[:20], ["not json", '{"id": "y"}']),
        "p1.parquet": bad_parquet,
        "p2.parquet": _parquet(rows[40:]),
    }
    _put(s3_server, bucket, "bad", files)
    local = _write(tmp_path / "bad", files)
    for spec, ck in ((f"s3://{bucket}/bad", _ck(s3_server)), (str(local), None)):
        ds = load_dataset(spec, 0.1, ck)
        assert ds.n == N and ds.bad_rows == 4
        assert [(s.rows, s.bad_rows) for s in ds.shards] == [(20, 2), (20, 2), (20, 0)]
        with pytest.raises(
            DataError,
            match=r"task.dataset: 4 of 64 rows .* malformed .* first: p0.jsonl: line 21: not JSON",
        ):
            load_dataset(spec, 0.05, ck)
    # a Parquet shard without a required column fails, naming it and the shard
    _put(s3_server, bucket, "nocol", {"x.parquet": _parquet_structs([{"id": "a", "task": "t"}])})
    with pytest.raises(
        DataError, match=rf"task.dataset: s3://{bucket}/nocol/x.parquet has no column"
    ):
        load_dataset(f"s3://{bucket}/nocol/", 0.5, _ck(s3_server))


def test_a_shard_rewritten_or_deleted_after_the_index_is_refused(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    rows = _rows()
    files = _layouts(rows)["parquet-shards"]
    _put(s3_server, bucket, "rw", files)
    ck = _ck(s3_server)
    ds = load_dataset(f"s3://{bucket}/rw/", 0.0, ck)
    ds.window(0, 5, 0)  # reads (and caches) the first shard of the order
    changed = ds.shards[1].name
    s3_server.client().put_object(
        Bucket=bucket, Key=f"rw/{changed}", Body=_parquet(list(reversed(rows[20:45])))
    )
    with pytest.raises(SourceChanged, match=rf"task.dataset: s3://{bucket}/rw/{changed} changed"):
        for start in range(0, 2 * N, 10):
            ds.window(start, 10, 0)
    # locally: size+mtime, then the sha256
    local = _write(tmp_path / "rw", files)
    ds = load_dataset(str(local), 0.0)
    (local / "part-2.parquet").write_bytes(_parquet(list(reversed(rows[45:]))))
    with pytest.raises(SourceChanged, match=r"task.dataset: .*part-2.parquet changed"):
        for start in range(0, 2 * N, 10):
            ds.window(start, 10, 0)
    # same size, same mtime, other bytes: the sha256 refuses it
    f = tmp_path / "same.jsonl"
    f.write_bytes(_jsonl(rows))
    ds = load_dataset(str(f), 0.0)
    st = f.stat()
    f.write_bytes(_jsonl(rows).replace(b'"r001"', b'"r00X"'))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(SourceChanged, match=r"task.dataset: .*same.jsonl changed .*its sha256"):
        ds.window(0, 1, 0)
    ds = load_dataset(str(local), 0.0)
    (local / "part-0.parquet").unlink()
    with pytest.raises(SourceChanged, match=r"task.dataset: .*part-0.parquet was deleted"):
        for start in range(0, 2 * N, 10):
            ds.window(start, 10, 0)


def test_missing_sources_are_refused_naming_the_field_and_the_key(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    ck = _ck(s3_server)
    _put(s3_server, bucket, "junk", {"notes.txt": b"x", "sub/y.csv": b"y"})
    cases = [
        (f"s3://{bucket}/nope.jsonl", rf"task.dataset: s3://{bucket}/nope.jsonl holds no objects"),
        (f"s3://{bucket}/junk/", rf"task.dataset: s3://{bucket}/junk/ holds no \*.jsonl"),
        (
            "s3://no-such-bucket-xyz/d/",
            r"task.dataset: listing s3://no-such-bucket-xyz/d/: no such",
        ),
    ]
    for uri, msg in cases:
        with pytest.raises(DataError, match=msg):
            load_dataset(uri, 0.0, ck)
    with pytest.raises(DataError, match=rf"reward_model.data: s3://{bucket}/junk/ holds no"):
        load_preferences(f"s3://{bucket}/junk/", 0.0, ck=ck)
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        DataError, match=r"task.dataset: .*empty is a directory, not a file, and holds no \*.jsonl"
    ):
        load_dataset(str(tmp_path / "empty"), 0.0)


def test_a_window_reads_only_the_shards_it_needs(s3_server: S3Server, bucket: str) -> None:
    rows = _rows(200)
    files = {f"s{i:02d}.jsonl": _jsonl(rows[i * 20 : (i + 1) * 20]) for i in range(10)}
    _put(s3_server, bucket, "ten", files)
    ds = load_dataset(f"s3://{bucket}/ten/", 0.0, _ck(s3_server))
    assert ds.shards_parsed == 0 and ds.held_rows == 0  # the index holds no rows
    for it in range(10):  # an epoch in windows of 20: each window is one shard
        assert len({int(r.id[1:]) // 20 for r in ds.batch(it, 20, 4)}) == 1  # one shard
        assert ds.shards_parsed == it + 1 and ds.held_rows <= Dataset.CACHED_SHARDS * 20
    ds.batch(10, 20, 4)  # the next epoch starts with the shard read first, evicted since
    assert ds.shards_parsed == 11
    ds.window(15, 10, 4)  # straddles the first two shards of the order: one more read
    assert ds.shards_parsed == 12 and ds.held_rows == 40
    assert len(ds.rows) == 200 and ds.held_rows == 240  # `rows` holds all: small sets only


def test_preferences_from_s3_load_the_same_pairs_as_locally(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    pairs = [
        {"id": f"p{i}", "prompt": f"copy {i}=", "chosen": str(i), "rejected": str(i + 1)}
        for i in range(30)
    ]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(pairs[10:]), sink)
    files = {"a.jsonl": _jsonl(pairs[:10]), "b.parquet": sink.getvalue().to_pybytes()}
    _put(s3_server, bucket, "prefs", files)
    local = _write(tmp_path / "prefs", files)
    a = load_preferences(str(local), 0.0)
    b = load_preferences(f"s3://{bucket}/prefs/", 0.0, ck=_ck(s3_server))
    assert a.rows == b.rows == [PreferencePair(**p) for p in pairs] and a.bad_rows == 0
    assert [s.sha256 for s in a.shards] == [s.sha256 for s in b.shards]
    one = load_preferences(f"s3://{bucket}/prefs/b.parquet", 0.0, ck=_ck(s3_server))
    assert one.rows == a.rows[10:]
    _put(s3_server, bucket, "dup", {"a.jsonl": _jsonl(pairs[:3]), "b.jsonl": _jsonl(pairs[2:4])})
    with pytest.raises(DataError, match=r"reward_model.data: id 'p2' appears more than once"):
        load_preferences(f"s3://{bucket}/dup/", 0.0, ck=_ck(s3_server))


def test_the_mlflow_dataset_input_records_the_shard_digest(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from moerl.tracking import log_dataset_input

    files = _layouts(_rows())["parquet-shards"]
    _put(s3_server, bucket, "ml", files)
    uri = f"s3://{bucket}/ml/"
    cfg = parse_config(
        {
            "task": {"dataset": uri},
            "checkpoint": {"uri": f"s3://{bucket}/ck", "endpoint_url": s3_server.endpoint_url},
            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        }
    )
    client = MlflowClient(cfg.tracking.uri)
    run_id = client.create_run(client.create_experiment("data")).info.run_id
    log_dataset_input(client, run_id, cfg)
    run = client.get_run(run_id)
    assert "moerl.dataset_input_error" not in run.data.tags
    (inp,) = run.inputs.dataset_inputs
    shas = [hashlib.sha256(files[n]).hexdigest() for n in sorted(files)]
    want = hashlib.sha256(
        "".join(f"{n} {s}\n" for n, s in zip(sorted(files), shas)).encode()
    ).hexdigest()[:16]
    assert inp.dataset.digest == want == digest(load_dataset(uri, 0.0, cfg.checkpoint).shards)
    assert inp.dataset.source_type == "s3" and json.loads(inp.dataset.source) == {"uri": uri}
    prof = json.loads(inp.dataset.profile)
    assert prof["rows"] == N and prof["shards"] == 3 and prof["bad_rows"] == 0
    assert [(s["uri"], s["sha256"], s["rows"]) for s in prof["shard_list"]] == [
        (f"{uri}{n}", sha, r) for n, sha, r in zip(sorted(files), shas, (20, 25, 15))
    ]

    # every later stage reads the shards the run started on: the same pass, a rewritten shard
    # (a new stage's fresh index, between iterations) is refused naming the field
    from moerl.tracking import check_pinned

    check_pinned(load_dataset(uri, 0.0, cfg.checkpoint), cfg, run_id)
    first = sorted(files)[0]
    _put(s3_server, bucket, "ml", {first: files[sorted(files)[1]]})
    with pytest.raises(
        SourceChanged, match=f"task.dataset: {uri} is not what run {run_id} started on"
    ):
        check_pinned(load_dataset(uri, 0.0, cfg.checkpoint), cfg, run_id)
