"""Where `task.dataset` and `reward_model.data` rows come from: a shipped file, a local file or
folder of shards, or an S3 object or prefix (`*.jsonl`, `*.jsonl.gz`, `*.parquet`, sorted by
name). Each shard is streamed (one shard's rows in memory at a time) and indexed once: size,
version (S3 ETag or local mtime), sha256, good and bad rows. A later read of a shard that was
rewritten or deleted is refused (`SourceChanged`), never mixed with the indexed rows.

Design, details and limitations: docs/tasks.md#moerltasksdatasetpy.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dc_field
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO, Generic

from pydantic import ValidationError

from moerl.config import CheckpointConfig
from moerl.errors import DataError
from moerl.records import R
from moerl.store.sources import S3Object, S3Source, SourceChanged
from moerl.userfiles import FileProblem, decode_text, kind_problem, one_line

SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
BLOCK = 1 << 20  # a local shard's read block
MAX_PROFILE_SHARDS = 100  # shards listed in an MLflow dataset profile


@dataclass(frozen=True)
class Shard:
    """One file of a source: its name under the source ("/"-separated; a single file's own
    name), where it lives, and what the index found in it."""

    name: str
    uri: str
    size: int
    version: str  # S3: the ETag; local: the mtime in ns
    sha256: str = ""
    rows: int = 0
    bad_rows: int = 0

    @property
    def fmt(self) -> str:
        n = self.name.lower()
        if n.endswith((".parquet", ".pq")):
            return "parquet"
        return "jsonl.gz" if n.endswith(".gz") else "jsonl"


@dataclass(frozen=True)
class RowKind(Generic[R]):
    """How a row of one kind of data is read: its record class, its fields (Parquet columns),
    those a row must give as strings, those that may be JSON text in Parquet, a last check."""

    cls: type[R]
    field: str
    schema: str
    columns: tuple[str, ...]
    required: tuple[str, ...]
    json_fields: tuple[str, ...] = ()
    check: Callable[[R], R] = dc_field(default=lambda r: r)
    one_of: tuple[str, ...] = ()  # Parquet: at least one of these columns


class Source:
    """The shards of `spec` for config `field`, listed once (names sorted)."""

    def __init__(self, spec: str, field: str, schema: str, ck: CheckpointConfig | None) -> None:
        self.spec, self.field, self.schema = spec, field, schema
        self.s3: S3Source | None = None
        self._objs: dict[str, S3Object] = {}
        if spec.startswith("s3://"):
            self.s3 = S3Source(spec, ck or CheckpointConfig(), field, DataError)
            objs = self.s3.list()
            single = len(objs) == 1 and objs[0].rel == ""
            if single:
                self._objs = {spec.rstrip("/").rsplit("/", 1)[-1]: objs[0]}
            else:
                self._objs = {o.rel: o for o in objs if o.rel.lower().endswith(SUFFIXES)}
            if not self._objs:
                raise DataError(
                    f"{field}: {spec} holds no {', '.join('*' + s for s in SUFFIXES)} objects "
                    f"(of {len(objs)}); expected an object or a prefix of {schema} shards"
                )
            self.listing = [
                Shard(n, self.s3.url(o.rel), o.size, o.etag) for n, o in sorted(self._objs.items())
            ]
            return
        p = Path(spec).expanduser()
        if not spec.startswith("builtin:") and p.is_dir():
            files = sorted(
                (x.relative_to(p).as_posix(), x)
                for x in p.rglob("*")
                if x.is_file() and x.name.lower().endswith(SUFFIXES)
            )
            if not files:
                raise DataError(
                    f"{field}: {p} is a directory, not a file, and holds no "
                    f"{', '.join('*' + s for s in SUFFIXES)} shards; expected a file or a folder "
                    f"of {schema} shards"
                )
        else:
            p = resolve_path(spec, field, schema)
            files = [(p.name, p)]
        self.listing = []
        for name, x in files:
            try:
                st = x.stat()
            except OSError as err:
                raise DataError(f"{field}: cannot read {x} ({err.strerror or err})") from None
            self.listing.append(Shard(name, str(x), st.st_size, str(st.st_mtime_ns)))

    def chunks(self, shard: Shard) -> Iterator[bytes]:
        """The shard's bytes in blocks, refused if it changed since it was listed."""
        if self.s3 is not None:
            yield from self.s3.stream(self._objs[shard.name])
            return
        p = Path(shard.uri)
        try:
            with p.open("rb") as f:
                st = os.fstat(f.fileno())  # the file opened: what is read
                if (st.st_size, str(st.st_mtime_ns)) != (shard.size, shard.version):
                    raise _changed(self.field, shard, "its size or mtime")
                got = 0
                while block := f.read(BLOCK):
                    got += len(block)
                    yield block
        except FileNotFoundError:
            raise SourceChanged(
                f"{self.field}: {shard.uri} was deleted after this run indexed it; a source must "
                "not change under a run: write a new file or prefix and start a new run"
            ) from None
        except OSError as err:
            raise DataError(
                f"{self.field}: cannot read {shard.uri} ({err.strerror or err})"
            ) from None
        if got != shard.size:
            raise _changed(self.field, shard, "its size")


def _changed(field: str, shard: Shard, what: str) -> SourceChanged:
    return SourceChanged(
        f"{field}: {shard.uri} changed after this run indexed it ({what} differ); a source must "
        "not change under a run: write a new file or prefix and start a new run"
    )


class _Hashing(io.RawIOBase):
    """A readable stream over blocks, hashing every byte that passes (and the rest, `drain`)."""

    def __init__(self, blocks: Iterator[bytes]) -> None:
        self._it, self._buf = blocks, memoryview(b"")
        self.sha, self.size = hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def _next(self) -> bool:
        for block in self._it:
            self.sha.update(block)
            self.size += len(block)
            if block:
                self._buf = memoryview(block)
                return True
        return False

    def readinto(self, b: Any) -> int:
        if not self._buf and not self._next():
            return 0
        k = min(len(b), len(self._buf))
        b[:k] = self._buf[:k]
        self._buf = self._buf[k:]
        return k

    def readall(self) -> bytes:
        parts = [bytes(self._buf)]
        self._buf = memoryview(b"")
        while self._next():
            parts.append(bytes(self._buf))
        self._buf = memoryview(b"")
        return b"".join(parts)

    def drain(self) -> None:
        while self._next():
            pass
        self._buf = memoryview(b"")


Item = tuple[str, Any]  # (where: "line 3" / "row 3", a record or the FileProblem)


def _jsonl(raw: _Hashing, gz: bool, kind: RowKind[R]) -> Iterator[Item]:
    f: Any = io.BufferedReader(raw, 1 << 16)
    if gz:
        f = gzip.GzipFile(fileobj=f, mode="rb")
    for lineno, line in _lines(f):
        if line is not None and not line.strip():
            continue
        try:
            yield f"line {lineno}", kind.check(validate_row(kind.cls, json_line(line), kind.schema))
        except FileProblem as problem:
            yield f"line {lineno}", problem


def _cell(kind: RowKind[R], rec: dict[str, Any]) -> dict[str, Any]:
    """A Parquet record as the JSON row it stands for (see docs: nulls, JSON text, maps)."""
    for k in kind.required:
        if not isinstance(rec.get(k), str):
            raise FileProblem(f"{k}: expected a string, got {type(rec.get(k)).__name__}")
    out = {}
    for k, v in rec.items():
        if v is None:
            continue
        if k in kind.json_fields and isinstance(v, str):
            try:
                v = json.loads(v)
            except (json.JSONDecodeError, RecursionError):
                raise FileProblem(f"{k}: not JSON text") from None
        if isinstance(v, list) and v and all(isinstance(x, tuple) and len(x) == 2 for x in v):
            v = dict(v)  # a Parquet map
        out[k] = v
    return out


def _parquet(raw: _Hashing, shard: Shard, kind: RowKind[R]) -> Iterator[Item]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = raw.read()  # a Parquet file is read whole: its footer comes last
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        names = pf.schema_arrow.names
        missing = [c for c in kind.required if c not in names]
        if not missing and kind.one_of and not any(c in names for c in kind.one_of):
            missing = [" or ".join(kind.one_of)]
        if missing:
            raise DataError(
                f"{kind.field}: {shard.uri} has no column(s) {', '.join(missing)}; a row is "
                f"{kind.schema} (columns: {', '.join(names) or 'none'})"
            )
        cols = [c for c in kind.columns if c in names]
        i = 0
        for batch in pf.iter_batches(batch_size=4096, columns=cols):
            for rec in batch.to_pylist():
                i += 1
                try:
                    yield (
                        f"row {i}",
                        kind.check(validate_row(kind.cls, _cell(kind, rec), kind.schema)),
                    )
                except FileProblem as problem:
                    yield f"row {i}", problem
    except (pa.ArrowException, OSError) as err:
        raise DataError(
            f"{kind.field}: {shard.uri} is not a readable Parquet file ({one_line(str(err))[:300]})"
        ) from None


class Scan(Generic[R]):
    """Every row of `shard` in file order, (where, record or FileProblem); once read through,
    `sha256` and `size` are its bytes', and a shard whose index gave another sha256 is refused."""

    def __init__(self, src: Source, shard: Shard, kind: RowKind[R]) -> None:
        self.src, self.shard, self.kind = src, shard, kind
        self.sha256, self.size = "", 0

    def __iter__(self) -> Iterator[Item]:
        shard, kind = self.shard, self.kind
        raw = _Hashing(self.src.chunks(shard))
        try:
            if shard.fmt == "parquet":
                yield from _parquet(raw, shard, kind)
            else:
                yield from _jsonl(raw, shard.fmt == "jsonl.gz", kind)
        except (gzip.BadGzipFile, EOFError, zlib.error) as err:
            raise DataError(
                f"{kind.field}: {shard.uri} is not a readable gzip file ({err})"
            ) from None
        raw.drain()
        self.sha256, self.size = raw.sha.hexdigest(), raw.size
        if shard.sha256 and self.sha256 != shard.sha256:
            raise _changed(kind.field, shard, "its sha256")


@dataclass
class Index(Generic[R]):
    """What indexing a source found: the shards with their hashes and counts."""

    shards: list[Shard]
    first_bad: str | None = None

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def bad_rows(self) -> int:
        return sum(s.bad_rows for s in self.shards)


def index(src: Source, kind: RowKind[R], on_row: Callable[[R], None]) -> Index[R]:
    """Read every shard once (streamed), giving each good row to `on_row`."""
    out: Index[R] = Index([])
    for shard in src.listing:
        good = bad = 0
        sc = Scan(src, shard, kind)
        for where, item in sc:
            if isinstance(item, FileProblem):
                bad += 1
                if out.first_bad is None:
                    at = f"{shard.name}: " if len(src.listing) > 1 else ""
                    out.first_bad = f"{at}{where}: {str(item).removeprefix('is ')}"
            else:
                good += 1
                on_row(item)
        out.shards.append(
            Shard(shard.name, shard.uri, sc.size, shard.version, sc.sha256, good, bad)
        )
    return out


def check_budget(src: Source, idx: Index[Any], field: str, max_bad_fraction: float) -> None:
    """Refuse an empty source or one with too many malformed rows, naming `field`."""
    bad, total = idx.bad_rows, idx.rows + idx.bad_rows
    if total == 0:
        raise DataError(f"{field}: {src.spec} has no rows (the file is empty or blank)")
    if bad / total > max_bad_fraction:
        raise DataError(
            f"{field}: {bad} of {total} rows in {src.spec} are malformed "
            f"({bad / total:.1%} > task.max_bad_fraction {max_bad_fraction:.1%}); first: {idx.first_bad}"
        )


def digest(shards: list[Shard]) -> str:
    """The dataset's digest: one shard's sha256, or the sha256 of "<name> <sha256>\\n" per
    shard in name order; 16 hex digits (MLflow's dataset digest)."""
    if len(shards) == 1:
        return shards[0].sha256[:16]
    text = "".join(f"{s.name} {s.sha256}\n" for s in sorted(shards, key=lambda s: s.name))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def index_sha256(shards: list[Shard]) -> str:
    """sha256 over every shard's name, sha256 and good-row count: what a run's stages must all
    read (`moerl.dataset.index_sha256`, checked by `check_pinned`)."""
    text = "".join(f"{s.name} {s.sha256} {s.rows}\n" for s in sorted(shards, key=lambda s: s.name))
    return hashlib.sha256(text.encode()).hexdigest()


def profile(shards: list[Shard]) -> dict[str, Any]:
    """Rows, bytes and the shards (uri, sha256, rows, bad rows; the first MAX_PROFILE_SHARDS)."""
    return {
        "rows": sum(s.rows for s in shards),
        "bad_rows": sum(s.bad_rows for s in shards),
        "bytes": sum(s.size for s in shards),
        "shards": len(shards),
        "digest_scheme": "sha256 of the one shard; else sha256 over '<name> <sha256>\\n' by name",
        "shard_list": [
            {"uri": s.uri, "sha256": s.sha256, "rows": s.rows, "bad_rows": s.bad_rows}
            for s in shards[:MAX_PROFILE_SHARDS]
        ],
    }


def resolve_path(
    spec: str, field: str = "task.dataset", rows: str = "{id, task, prompt, answer}"
) -> Path:
    """`builtin:<name>` (a file shipped in moerl/data) or a path to a user's regular file; a
    DataError naming `field` otherwise."""
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        known = sorted(
            x.name.removesuffix(".jsonl")
            for x in resources.files("moerl.tasks.data").iterdir()
            if x.name.endswith(".jsonl")
        )
        # Only the names listed: "builtin:../x" must not reach outside the package.
        if name not in known:
            raise DataError(
                f"{field}: no builtin dataset {one_line(repr(name))}; builtin: {', '.join(known)}"
            )
        return Path(str(resources.files("moerl.tasks.data").joinpath(f"{name}.jsonl")))
    p = Path(spec).expanduser()
    what = kind_problem(p)
    if what == "does not exist":
        raise DataError(f"{field}: file not found: {p}")
    if what:
        raise DataError(f"{field}: {p} {what}; expected a JSONL file of {rows} rows")
    return p


MAX_LINE_BYTES = 1 << 20  # 1 MiB: a prompt row is a few hundred bytes; longer is a wrong file


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(line number, raw line) for each line; None for a line over MAX_LINE_BYTES, whose rest
    is skipped in bounded reads, so a file with no newline never fills memory."""
    lineno = 0
    while chunk := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(chunk) <= MAX_LINE_BYTES or chunk.endswith(b"\n"):
            yield lineno, chunk
            continue
        while chunk and not chunk.endswith(b"\n"):
            chunk = f.readline(MAX_LINE_BYTES)
        yield lineno, None


def json_line(raw: bytes | None) -> object:
    """One line of a JSONL file (from `_lines`) decoded, or FileProblem saying why not."""
    if raw is None:
        raise FileProblem(f"longer than {MAX_LINE_BYTES // (1 << 20)} MiB")
    text = decode_text(raw, single_line=True)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FileProblem(f"not JSON ({err.msg} at column {err.colno})") from None
    except RecursionError:
        raise FileProblem("JSON nested too deeply") from None


def validate_row(cls: type[R], obj: object, rows: str) -> R:
    """`obj` as a `cls` record, or FileProblem naming the first bad field and the schema."""
    try:
        return cls.model_validate(obj)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        where = ".".join(str(x) for x in e["loc"]) or "row"
        raise FileProblem(one_line(f"{where}: {e['msg']}; a row is {rows}")) from None
