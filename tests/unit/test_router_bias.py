"""DeepSeek-V3's auxiliary-loss-free balancing (`steps.RouterBias`): the rule on known loads,
and what it refuses."""

import pytest
import torch
from torch import nn

from moerl.components.policy_update.steps import RouterBias
from moerl.errors import TrainingError


class _Router(nn.Module):
    """Shaped like DeepSeek-V3's router: (logits, weights, top-k ids) and the bias buffer."""

    def __init__(self, experts: int):
        super().__init__()
        self.e_score_correction_bias = nn.Buffer(torch.zeros(experts))
        self.next_idx = None

    def forward(self, x):
        return None, None, self.next_idx


class _Block(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.gate = _Router(experts)


class _Model(nn.Module):
    def __init__(self, layers: int = 2, experts: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(_Block(experts) for _ in range(layers))


def _route(model, idx_per_layer):
    for block, idx in zip(model.layers, idx_per_layer):
        block.gate.next_idx = torch.tensor(idx)
        block.gate(None)


def test_each_bias_moves_one_rate_towards_the_mean_load():
    model = _Model()
    bias = RouterBias(model, rate=0.01)
    model.train()
    # layer 0: expert 0 takes 4 of 8 choices, 1 and 2 two each... mean 2; layer 1 balanced
    _route(model, [[[0, 1], [0, 2], [0, 1], [0, 2]], [[0, 1], [2, 3], [0, 1], [2, 3]]])
    model.eval()  # the pi_old pass: not counted
    _route(model, [[[3, 3]] * 50, [[3, 3]] * 50])
    stats = bias.step()
    b0, b1 = (blk.gate.e_score_correction_bias for blk in model.layers)
    # overloaded down, idle up, at the mean stays
    assert b0.tolist() == pytest.approx([-0.01, 0.0, 0.0, 0.01])
    assert b1.tolist() == [0.0] * 4
    assert stats["moe/router_max_load_ratio"] == pytest.approx((4 / 2 + 2 / 2) / 2)
    model.train()  # a skipped step drops its counts: nothing moves on the next step without tokens
    _route(model, [[[0, 0]], [[0, 0]]])
    bias.reset()
    bias.step()
    assert b0.tolist() == pytest.approx([-0.01, 0.0, 0.0, 0.01])
    bias.close()
    _route(model, [[[0, 0]], [[0, 0]]])  # hooks removed: not counted
    assert float(bias.load_RE.sum()) == 0.0


def test_a_router_without_the_bias_is_refused_naming_the_key():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                vocab_size=32,
                hidden_size=32,
                intermediate_size=32,
                moe_intermediate_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                num_experts=4,
            )
        )
    with pytest.raises(
        TrainingError,
        match="trainer.moe.router_bias_update_rate 0.001: Qwen3MoeForCausalLM has no router",
    ):
        RouterBias(model, 0.001)
