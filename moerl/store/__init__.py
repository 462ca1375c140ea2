"""Where policy versions live: the checkpoint store, its backends, and the node-local cache.

- `base`: the contract (`CheckpointStore`): publish, list, fetch, pin, prune, recover; the
  layout under a root or s3://bucket/prefix; verified streaming fetch.
- `folder`, `s3`: its two backends (a local folder; S3 through boto3).
- `manifest`: a version's manifest (every file's path, size and sha256) and its hash.
- `leases`: pins as leases that expire when their holder stops renewing them.
- `nodecache`: the node-local cache of fetched versions: locks, verified markers, pruning.
- `runs`: a run's node cache and what an engine fetches (`fetch_for_engine`, `engine_copy`).
- `tiers`: where a version lives (node cache, cache tier, durable store), the backend chosen for
  a URI (`open_store`), a run's lineage (`run_store`, `run_tiers`), the nearest verified copy,
  recovery across tiers.
- `fanout`: engines fetching a version from each other, chunk by chunk, each chunk verified.
- `s3server`: a real S3 server on loopback (`weed mini`) for tests and benchmarks.

New storage code goes here. Every module imports only
the shared modules at the top of `moerl/` and its siblings; the contract never imports a backend.
"""
