"""The expert-parallel trainer against the single-process transformers model:
forward logits, one step's loss and every gradient, for EP = 2 and EP = 4 (gloo, CPU)."""

import pytest
import torch

from moerl.config import parse_config
from moerl.models.tiny import build_tiny_model
from tests.support import ep_worker

TOL = 1e-5  # float32; the EP path sums the same products in a different order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(parse_config({}).model.tiny, tmp_path_factory.mktemp("ep") / "model")


@pytest.fixture(scope="module")
def reference(tiny):
    model = ep_worker.tiny_model(tiny)
    packed = ep_worker.batch_tensors()
    n = packed.input_ids_NL.shape[0]
    with torch.no_grad():
        logits = model(input_ids=packed.input_ids_NL, attention_mask=packed.attn_NL).logits
    loss = ep_worker.step_loss_and_grads(
        model, packed, torch.arange(n), n_tokens=float(packed.mask_NL1.sum())
    )
    return model, logits, loss.detach()


@pytest.mark.slow
@pytest.mark.parametrize("world, backend", [(2, "all_to_all"), (4, "hierarchical")])
def test_ep_step_equals_single_process(tiny, reference, tmp_path, world, backend, gloo_worlds):
    ref_model, ref_logits, ref_loss = reference
    gloo_worlds(world).run(ep_worker.ep_rank, str(tiny), backend, str(tmp_path))
    outs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    # forward
    for o in outs:
        assert (o["logits"] - ref_logits[o["mine"]]).abs().max() <= TOL
    # loss: the ranks' losses sum to the single-process loss
    assert abs(outs[0]["loss"].item() - ref_loss.item()) <= TOL
    ref = dict(ref_model.named_parameters())
    # replicated gradients, all-reduced: equal on every rank and to the reference
    for o in outs:
        for name, g in o["grads"].items():
            assert (g - ref[name].grad).abs().max() <= TOL, name
    assert len(outs[0]["grads"]) == len([n for n in ref if "experts" not in n])
    # expert gradients, gathered from their shards, and the gathered weights are the checkpoint's
    layers = [m for n, m in ref_model.named_modules() if n.endswith("mlp.experts")]
    for (g_gu, g_dn), (w_gu, w_dn), experts in zip(
        outs[0]["expert_grads"], outs[0]["expert_weights"], layers
    ):
        assert (g_gu - experts.gate_up_proj.grad).abs().max() <= TOL
        assert (g_dn - experts.down_proj.grad).abs().max() <= TOL
        assert torch.equal(w_gu, experts.gate_up_proj.detach()) and torch.equal(
            w_dn, experts.down_proj.detach()
        )


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [10, 0, 0, 0], [1, 1, 1, 1]])
def test_grouped_experts_equal_the_per_expert_loop_forward_and_backward(counts):
    from torch.nn import functional as F

    from moerl.components.policy_update.ep_moe import LocalExperts
    from tests.support.oracles import experts_loop

    g = torch.Generator().manual_seed(sum(counts) + len(counts))
    n_local, h, i = len(counts), 16, 8
    counts_L = torch.tensor(counts)
    x = torch.randn(int(counts_L.sum()), h, generator=g)
    grad_out = torch.randn(x.shape[0], h, generator=g)
    got = []
    for fn in (lambda m, x: m(x, counts_L), lambda m, x: experts_loop(m, x, counts_L)):
        torch.manual_seed(0)
        m = LocalExperts(
            torch.randn(n_local, 2 * i, h, generator=torch.Generator().manual_seed(1)),
            torch.randn(n_local, h, i, generator=torch.Generator().manual_seed(2)),
            F.silu,
        )
        xx = x.clone().requires_grad_()
        y = fn(m, xx)
        y.backward(grad_out, retain_graph=True)
        y.sum().backward()  # an expanded incoming gradient as well
        got.append((y.detach(), xx.grad, m.gate_up_proj_LIH.grad, m.down_proj_LHI.grad))
    for a, b in zip(*got):
        assert a.shape == b.shape and (a.numel() == 0 or (a - b).abs().max() <= 1e-5)


def test_a_moe_block_with_a_part_it_cannot_place_is_refused_not_dropped():
    """A sparse block holding anything besides its router, experts and shared experts would lose
    it in the expert-parallel block: refused, naming it."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moerl.components.policy_update.ep_moe import parallelize_experts
    from moerl.kernels import make_dispatcher

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg)
        model.model.layers[0].mlp.expert_bias_proj = torch.nn.Linear(32, 4)  # a part no family has
    with pytest.raises(
        ValueError, match=r"holds expert_bias_proj besides its router, experts and shared experts"
    ):
        parallelize_experts(model, make_dispatcher("local", num_experts=4))


def test_the_softmax_aux_loss_is_refused_for_a_sigmoid_router():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from moerl.components.policy_update.ep_moe import parallelize_experts
    from moerl.kernels import make_dispatcher

    cfg = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
    )
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(cfg)
    with pytest.raises(ValueError, match="trainer.moe.aux_loss_coef > 0: .* sigmoid router"):
        parallelize_experts(model, make_dispatcher("local", num_experts=4), aux_loss_coef=0.01)
    assert parallelize_experts(model, make_dispatcher("local", num_experts=4))  # without it: fine
