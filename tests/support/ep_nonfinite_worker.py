"""Worker body for tests/trainer/test_ep_equivalence.py: the real `train_ep` on 2 gloo ranks, with a
NaN injected into one expert gradient on rank 1 only (the loss stays finite everywhere)."""

import json

import torch
import torch.distributed as dist


def rank_main(rank, world, model_path, batch_path, out_dir):
    # a job of tests/support/gloo_world.py: the world's process group is already up
    from transformers import AutoModelForCausalLM

    from moerl.components.policy_update.ep_moe import parallelize_experts
    from moerl.components.policy_update.ep_train import train_ep
    from moerl.components.policy_update.trainer import Counters
    from moerl.config import parse_config
    from moerl.errors import TrainingError
    from moerl.kernels import make_dispatcher
    from moerl.records import TrainSample, read_records

    cfg = parse_config(
        {
            "trainer": {
                "optimizer": {
                    "optimizer_steps_per_iteration": 4,
                    "max_consecutive_skipped_steps": 3,
                },
                "parallelism": {"expert_parallel_size": world},
            }
        }
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    disp = make_dispatcher(
        "all_to_all", num_experts=model.config.num_experts, group=dist.group.WORLD
    )
    blocks = parallelize_experts(model, disp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    if rank == 1:
        blocks[0].down_proj_LHI.register_hook(lambda g: torch.full_like(g, float("nan")))
    before = [p.detach().clone() for p in model.parameters()]
    counters = Counters()
    try:
        train_ep(model, opt, counters, blocks, read_records(batch_path, TrainSample), cfg, seed=0)
        error = ""
    except TrainingError as e:
        error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(
            {
                "error": error,
                "unchanged": unchanged,
                "finite": finite,
                "skipped_total": counters.skipped_total,
                "step": counters.step,
            },
            f,
        )
