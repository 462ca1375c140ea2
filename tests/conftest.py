"""Shared fixtures (one real S3 server per test session) and the suite's scheduling order.

`make test` runs the suite on two pytest-xdist workers with `--dist loadscope`: every module
runs whole on one worker, so a module's expensive fixture (a pipeline run shared by its tests)
is built once. The modules below hold most of the suite's time (pytest --durations on a fresh
clone, 2 cores): they are collected first so that they start at once, one per worker, and the
short modules fill in behind them. Order only: every test still runs.
"""

from tests.support.s3server import s3_server  # noqa: F401  (a session fixture, registered here)

LONGEST_FIRST = (
    "test_cluster_local.py",  # ~380 s: the EKS pipeline with tasks that share only servers
    "test_async_faults.py",  # ~340 s: SIGTERM/SIGKILL/trainer-kill/Valkey-restart runs
    "test_e2e_pipeline.py",  # ~225 s: reward model + GRPO end to end, a failing stage
    "test_multi_turn_learning.py",  # ~230 s: the lookup task learns in the async mode
    "test_async_mesh.py",  # ~260 s: a two-node persistent mesh learns; a rank killed mid-version
    "test_async_tensor_parallel.py",  # ~170 s: the default task with TP = 2 engines learns
    "test_resume.py",  # ~165 s: a run killed twice and resumed
    "test_trainer_mesh.py",  # ~150 s: four-rank FSDP2 meshes, families, a resume across meshes
    "test_persistent_mesh.py",  # ~120 s: versions kept in memory equal versions reloaded
    "test_bench_failures.py",  # ~165 s: a fault-free and a faulted async run
    "test_bench_scaling.py",  # ~90 s: async runs at 1 and 2 rollout workers
    "test_bench_suite.py",  # ~65 s: 2 repeats x 2 versions, the dispatch comparison
    "test_bench_modes.py",  # ~60 s: floor and async arms of one workload
    "test_engine_group.py",  # ~65 s: an engine over two simulated nodes, fetch, swap, drain
    "test_wide_ep.py",  # ~65 s: bench wide-ep legs against a real vLLM server
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a module, and among the rest, file order holds
