"""Worker bodies for the expert-parallel trainer tests (run under torch.multiprocessing spawn)."""

import os

import torch
import torch.distributed as dist


def tiny_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def batch_tensors(n=8):
    from moerl.records import TrainSample
    from moerl.components.policy_update.trainer import pack

    g = torch.Generator().manual_seed(0)
    batch = []
    for i in range(n):
        prompt = torch.randint(4, 27, (6,), generator=g).tolist()
        resp = torch.randint(4, 27, (4,), generator=g).tolist()
        batch.append(TrainSample(prompt_token_ids=prompt, response_token_ids=resp,
                                 response_logprobs=[-3.0 - 0.1 * j for j in range(4)],
                                 advantage=float((-1) ** i) * (1 + i / 10), policy_version=0))
    return pack(batch, pad_id=0)


def step_loss_and_grads(model, packed, idx, n_tokens):
    from moerl.components.policy_update.loss import grpo_token_loss
    from moerl.components.policy_update.trainer import sequence_logprobs

    with torch.no_grad():
        old, _ = sequence_logprobs(model, packed, idx, 1.0)
    logp, _ = sequence_logprobs(model, packed, idx, 1.0)
    loss, _ = grpo_token_loss(logp, old - 0.05, packed.engine_logp_NL1[idx], packed.adv_N[idx], packed.mask_NL1[idx],
                              0.2, 0.28, 2.0, n_tokens=n_tokens)
    loss.backward()
    return loss


def ep_rank(rank, world, model_path, backend, out_dir):
    # a file store for the rendezvous: no TCP listener; gloo itself stays on loopback
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    try:
        from moerl.kernels import make_dispatcher
        from moerl.components.policy_update.ep_moe import gather_full_experts, parallelize_experts
        from moerl.components.policy_update.ep_train import _sync_and_clip

        model = tiny_model(model_path)
        packed = batch_tensors()
        n = packed.input_ids_NL.shape[0]
        disp = make_dispatcher(backend, num_experts=model.config.num_experts, group=dist.group.WORLD,
                               ranks_per_node=2 if world == 4 else 1)
        blocks = parallelize_experts(model, disp)
        mine = torch.arange(n)[rank::world]
        # forward: logits of this rank's samples vs the single-process model (checked by the caller)
        with torch.no_grad():
            logits = model(input_ids=packed.input_ids_NL[mine], attention_mask=packed.attn_NL[mine]).logits
        loss = step_loss_and_grads(model, packed, mine, n_tokens=float(packed.mask_NL1.sum()))
        total = loss.detach().clone()
        dist.all_reduce(total)
        _sync_and_clip(model, blocks, max_norm=1e9)  # all-reduce replicated grads, no clipping
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
                 if p.grad is not None and "proj_L" not in name}
        full_grads = []
        for b in blocks:
            gu = [torch.zeros_like(b.gate_up_proj_LIH.grad) for _ in range(world)]
            dn = [torch.zeros_like(b.down_proj_LHI.grad) for _ in range(world)]
            dist.all_gather(gu, b.gate_up_proj_LIH.grad)
            dist.all_gather(dn, b.down_proj_LHI.grad)
            full_grads.append((torch.cat(gu), torch.cat(dn)))
        weights = [gather_full_experts(b) for b in blocks]
        torch.save({"loss": total, "grads": grads, "expert_grads": full_grads, "logits": logits, "mine": mine,
                    "expert_weights": weights}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
