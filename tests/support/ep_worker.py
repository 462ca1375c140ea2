"""Worker bodies for the expert-parallel trainer tests: jobs of the session's gloo worlds
(tests/support/gloo_world.py), run on every rank inside its process group."""

import torch
import torch.distributed as dist


def tiny_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def batch_tensors(n=8):
    from moerl.components.policy_update.trainer import pack
    from moerl.records import TrainSample

    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(n):
        prompt = torch.randint(4, 27, (6,), generator=g).tolist()
        resp = torch.randint(4, 27, (4,), generator=g).tolist()
        batch.append(
            TrainSample(
                prompt_token_ids=prompt,
                response_token_ids=resp,
                response_logprobs=[-3.0 - 0.1 * j for j in range(4)],
                advantage=float((-1) ** i) * (1 + i / 10),
                policy_version=0,
            )
        )
    return pack(batch, pad_id=0)


def step_loss_and_grads(model, packed, idx, n_tokens, chunk_tokens=0):
    from moerl.components.policy_update.trainer import sequence_logprobs
    from tests.support.oracles import grpo_token_loss

    with torch.no_grad():
        old, _ = sequence_logprobs(model, packed, idx, 1.0, chunk_tokens=chunk_tokens)
    logp, _ = sequence_logprobs(model, packed, idx, 1.0, chunk_tokens=chunk_tokens)
    loss, _ = grpo_token_loss(
        logp,
        old - 0.05,
        packed.engine_logp_NL1[idx],
        packed.adv_N[idx],
        packed.mask_NL1[idx],
        0.2,
        0.28,
        2.0,
        n_tokens=n_tokens,
    )
    loss.backward()
    return loss


def ep_rank(rank, world, model_path, backend, out_dir):
    # a job of tests/support/gloo_world.py: the world's process group is already up
    from moerl.components.policy_update.ep_moe import parallelize_experts
    from moerl.components.policy_update.ep_train import _sync_and_clip
    from moerl.kernels import make_dispatcher
    from tests.support.oracles import gather_full_experts

    model = tiny_model(model_path)
    packed = batch_tensors()
    n = packed.input_ids_NL.shape[0]
    disp = make_dispatcher(
        backend,
        num_experts=model.config.num_experts,
        group=dist.group.WORLD,
        ranks_per_node=2 if world == 4 else 1,
    )
    blocks = parallelize_experts(model, disp)
    mine = torch.arange(n)[rank::world]
    # forward: logits of this rank's samples vs the single-process model (checked by the caller)
    with torch.no_grad():
        logits = model(
            input_ids=packed.input_ids_NL[mine], attention_mask=packed.attn_NL[mine]
        ).logits
    loss = step_loss_and_grads(model, packed, mine, n_tokens=float(packed.mask_NL1.sum()))
    total = loss.detach().clone()
    dist.all_reduce(total)
    _sync_and_clip(model, blocks, max_norm=1e9)  # all-reduce replicated grads, no clipping
    grads = {
        name: p.grad.detach().clone()
        for name, p in model.named_parameters()
        if p.grad is not None and "proj_L" not in name
    }
    full_grads = []
    for b in blocks:
        gu = [torch.zeros_like(b.gate_up_proj_LIH.grad) for _ in range(world)]
        dn = [torch.zeros_like(b.down_proj_LHI.grad) for _ in range(world)]
        dist.all_gather(gu, b.gate_up_proj_LIH.grad)
        dist.all_gather(dn, b.down_proj_LHI.grad)
        full_grads.append((torch.cat(gu), torch.cat(dn)))
    weights = [gather_full_experts(b) for b in blocks]
    torch.save(
        {
            "loss": total,
            "grads": grads,
            "expert_grads": full_grads,
            "logits": logits,
            "mine": mine,
            "expert_weights": weights,
        },
        f"{out_dir}/rank{rank}.pt",
    )


def _full_expert_tensors(num_experts):
    """Live tensors anywhere in this process shaped like a whole layer of experts ([E, ...], 3-D)."""
    import gc

    gc.collect()
    return sum(
        1
        for o in gc.get_objects()
        if torch.is_tensor(o) and not o.is_meta and o.dim() == 3 and o.shape[0] == num_experts
    )


def ep_load_save_rank(rank, world, model_path, out_dir, shard_bytes, serving=None):
    """Load through the EP trainer's setup(), record what this rank holds, perturb the weights
    (replicated ones identically on every rank), and save the HF checkpoint to out_dir/saved
    (and, given a `serving` dtype name, in that dtype to out_dir/saved_<serving>)."""
    # a job of tests/support/gloo_world.py: the world's process group is already up
    import zlib
    from pathlib import Path

    from moerl.components.policy_update import ep_checkpoint
    from moerl.components.policy_update.ep_train import apply_fsdp, setup
    from moerl.config import parse_config

    cfg = parse_config({"trainer": {"parallelism": {"expert_parallel_size": world}}})
    # what the loader holds
    model, _, _, blocks, layout, _, mesh = setup(cfg, Path(model_path), shard=False)
    loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
    record = {
        "loaded": loaded,
        "numel": sum(p.numel() for p in model.parameters()),
        "full_expert_tensors": _full_expert_tensors(blocks[0].num_experts),
        "first_expert": blocks[0].first_expert,
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
    }
    expert_ids = {id(p) for b in blocks for p in (b.gate_up_proj_LIH, b.down_proj_LHI)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            seed = zlib.crc32(name.encode()) + (1000 * rank if id(p) in expert_ids else 0)
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    record["saved"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    kwargs = {} if shard_bytes is None else {"max_shard_bytes": shard_bytes}
    apply_fsdp(model, blocks, mesh)  # saved as the trainer saves: from FSDP's shards
    record["sharded_numel"] = sum(p.to_local().numel() for p in model.parameters())
    ep_checkpoint.save_ep_checkpoint(
        model,
        blocks,
        layout,
        Path(model_path),
        Path(out_dir) / "saved",
        ep_group=mesh.get_group("ep"),
        **kwargs,
    )
    if serving is not None:
        ep_checkpoint.save_ep_checkpoint(
            model,
            blocks,
            layout,
            Path(model_path),
            Path(out_dir) / f"saved_{serving}",
            ep_group=mesh.get_group("ep"),
            dtype=getattr(torch, serving),
            **kwargs,
        )
    torch.save(record, f"{out_dir}/rank{rank}.pt")
