"""Routing replay and routing agreement: the trainer's MoE routers, observed and steered.

Legend: T tokens of one forward (rows x positions, flattened as the router sees them),
Y MoE layers (in the model's order), K top-k, E experts, N samples, L packed length.

The trainer's router can choose other experts than the engine's for the same token (other
kernels, other reduction orders, bf16): the logprobs then differ by more than numerics, and
the rare tokens whose ratio explodes are what collapse MoE RL (docs/mismatch.md). Replay
removes that source (R3, arXiv 2510.11370; verl's `router_replay.mode`):

- `R3` forces the engine's recorded top-k ids (`TrainSample.routed_experts`) in every forward
  of the update, the pi_old pass included;
- `R2` forces the trainer's own routes, recorded in the pi_old pass, in the optimizer steps
  (the routes then stay fixed while the weights move within the iteration).

The gate weights are recomputed from the trainer's own router logits at the forced ids, in
exactly the arithmetic of the model's router (`_WEIGHTS`), so the router keeps its gradient;
where the forced ids equal the live ones the output is bit-identical to the plain forward.
A position without a recorded route (-1: the last token, padding, a sample without routes)
routes live.

A forward hook on each router class moerl knows does it, so the same code serves the plain
transformers block and the expert-parallel block (`ep_moe.EPMoEBlock` calls `self.gate`), and
activation checkpointing's recompute replays the same ids. A router class it does not know
is refused, never routed live in silence.

The same hooks measure agreement: in the pi_old pass, before any replacement, the live ids are
compared with the engine's (`moe/routing_agreement`: the fraction of the engine's K experts the
trainer also chose, overall and per layer; `moe/token_any_layer_mismatch_fraction`: tokens whose
expert set differs in at least one layer). Under replay the live ids of a layer are computed on
the replayed history of the layers before it (prime-rl's `router_replay_replace_rate`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from moerl.errors import TrainingError


def _softmax_weights(norm_attr: bool, cast: bool) -> Callable:
    def weights(gate, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        probs = (
            F.softmax(logits_TE, dtype=torch.float, dim=-1)
            if cast
            else F.softmax(logits_TE.float(), dim=-1)
        )
        w = probs.gather(1, ids_TK)
        if gate.norm_topk_prob if norm_attr else True:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits_TE.dtype) if cast else w

    return weights


def _sigmoid_weights(gate, logits_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: sigmoid scores (the bias only steers the choice), normalised, scaled."""
    w = logits_TE.sigmoid().gather(1, ids_TK)
    if gate.norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * gate.routed_scaling_factor


# Each router's gate weights at given ids, written as its forward computes them (transformers 5.19)
_WEIGHTS: dict[str, Callable] = {
    "Qwen3MoeTopKRouter": _softmax_weights(norm_attr=True, cast=True),
    "Qwen2MoeTopKRouter": _softmax_weights(norm_attr=True, cast=True),
    "OlmoeTopKRouter": _softmax_weights(norm_attr=True, cast=True),
    "MixtralTopKRouter": _softmax_weights(norm_attr=False, cast=False),
    "DeepseekV3TopkRouter": _sigmoid_weights,
}


# The HF model types whose routers `_WEIGHTS` knows (preflight refuses replay for others)
REPLAY_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3")


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE router of `model`, in layer order. A router moerl cannot replay is refused."""
    found, unknown = [], set()
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in _WEIGHTS:
            found.append(m)
        elif name.endswith(".gate") and hasattr(m, "top_k") and hasattr(m, "weight"):
            unknown.add(kind)
    if unknown:
        raise TrainingError(
            f"routing replay does not know the router {', '.join(sorted(unknown))}; it knows "
            f"{', '.join(sorted(_WEIGHTS))}: set trainer.router_replay disabled for this model"
        )
    return found


class RouterReplay:
    """Hooks on every router of `model`. Per forward: `force(ids_TYK)` (or None) replaces the
    routes; `record(True)` keeps the live ids of each layer ([T, K] per layer, `live()`)."""

    def __init__(self, model: torch.nn.Module):
        self.gates = routers(model)
        if not self.gates:
            raise TrainingError(
                "trainer.router_replay / routing metrics need an MoE model; this one has no router"
            )
        self.top_k = int(self.gates[0].top_k)
        self.num_experts = int(getattr(self.gates[0], "num_experts", 0))
        self._forced: torch.Tensor | None = None
        self._recording = False
        self._live: list[torch.Tensor | None] = [None] * len(self.gates)
        self.replaced = 0  # (token, layer) slots whose forced ids differed from the live ones
        self.forced_slots = 0  # (token, layer) slots that had a route to force
        self._handles = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    @property
    def layers(self) -> int:
        return len(self.gates)

    def _hook(self, layer: int):
        weights = _WEIGHTS[type(self.gates[layer]).__name__]

        def hook(module, args, output):
            logits_TE, w_TK, idx_TK = output
            if self._recording:
                self._live[layer] = idx_TK.detach().clone()
            forced = self._forced
            if forced is None:
                return None
            if forced.shape[0] != idx_TK.shape[0]:
                raise TrainingError(
                    f"routing replay: {forced.shape[0]} recorded tokens for a forward of "
                    f"{idx_TK.shape[0]} (a moerl bug: routes and batch out of step)"
                )
            want = forced[:, layer, :].to(idx_TK.device, torch.long)
            has = (want >= 0).all(-1, keepdim=True)
            ids = torch.where(has, want, idx_TK)
            if self._recording:  # counted once per forward that records (pi_old), not in recomputes
                differ = (torch.sort(ids, -1).values != torch.sort(idx_TK, -1).values).any(
                    -1
                ) & has[:, 0]
                self.replaced += int(differ.sum())
                self.forced_slots += int(has.sum())
            return logits_TE, weights(module, logits_TE, ids).to(w_TK.dtype), ids.to(idx_TK.dtype)

        return hook

    def force(self, ids_TYK: torch.Tensor | None) -> None:
        if ids_TYK is not None and (
            ids_TYK.shape[1] != self.layers or ids_TYK.shape[2] != self.top_k
        ):
            raise TrainingError(
                f"routing replay: the routes hold {ids_TYK.shape[1]} layers x top-{ids_TYK.shape[2]}; "
                f"the model has {self.layers} MoE layers x top-{self.top_k} (a checkpoint other than "
                "the one the engine served?)"
            )
        self._forced = ids_TYK

    def record(self, on: bool) -> None:
        self._recording = on
        self._live = [None] * len(self.gates)

    def live(self) -> torch.Tensor:
        """[T, Y, K] live ids of the last recorded forward."""
        if any(x is None for x in self._live):
            raise TrainingError("routing replay: a router did not run in the recorded forward")
        return torch.stack(self._live, dim=1)

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class Agreement:
    """Sums for the routing-agreement metrics over the (token, layer) slots with a reference."""

    def __init__(self, layers: int, device):
        self.overlap_Y = torch.zeros(layers, dtype=torch.float64, device=device)
        self.slots_Y = torch.zeros(layers, dtype=torch.float64, device=device)
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)
        self.tokens_mismatch = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, live_TYK: torch.Tensor, ref_TYK: torch.Tensor, valid_T: torch.Tensor) -> None:
        """`valid_T`: real positions; a slot counts where the reference has a route."""
        k = live_TYK.shape[-1]
        ref = ref_TYK.to(live_TYK.device, torch.long)
        has_TY = (ref >= 0).all(-1) & valid_T[:, None]
        hit_TYK = (live_TYK[..., :, None] == ref[..., None, :]).any(
            -1
        )  # live id also in the reference set
        overlap_TY = hit_TYK.sum(-1).double() / k
        self.overlap_Y += torch.where(has_TY, overlap_TY, 0.0).sum(0)
        self.slots_Y += has_TY.double().sum(0)
        token_has = has_TY.any(-1)
        self.tokens += token_has.double().sum()
        self.tokens_mismatch += (has_TY & (overlap_TY < 1.0)).any(-1).double().sum()

    def flat(self) -> torch.Tensor:
        return torch.cat(
            [self.overlap_Y, self.slots_Y, self.tokens[None], self.tokens_mismatch[None]]
        )

    @staticmethod
    def metrics(flat: torch.Tensor, layers: int) -> dict[str, float]:
        overlap, slots = flat[:layers], flat[layers : 2 * layers]
        tokens, mismatch = float(flat[-2]), float(flat[-1])
        if tokens == 0:
            return {}
        out = {
            "moe/routing_agreement": float(overlap.sum() / slots.sum().clamp_min(1)),
            "moe/token_any_layer_mismatch_fraction": mismatch / tokens,
            "moe/routing_tokens": tokens,
        }
        out.update(
            {
                f"moe/routing_agreement/layer_{i}": float(o / max(float(s), 1.0))
                for i, (o, s) in enumerate(zip(overlap, slots))
                if s > 0
            }
        )
        return out
