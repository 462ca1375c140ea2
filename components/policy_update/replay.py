"""Routing replay (R2, R3) and routing agreement: forward hooks on the trainer's MoE routers
that force recorded top-k ids and compare the live ones with the engine's. Design and metrics:
docs/mismatch.md, sections 2 and 3; each family's router arithmetic: moerl/models/families/.

Legend: T tokens of one forward (rows x positions, flattened as the router sees them),
Y MoE layers (in the model's order), K top-k, E experts, N samples, L packed length.
"""

from __future__ import annotations

import torch

from moerl.errors import TrainingError
from moerl.models.families import router_classes
from moerl.models.families.base import RouterWeights


def _weights() -> dict[str, RouterWeights]:
    """Each known router's gate weights at given ids, as its family computes them."""
    return {name: f.router_weights for name, f in router_classes().items() if f.router_replay}


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every MoE router of `model`, in layer order. A router moerl cannot replay is refused."""
    known = _weights()
    found, unknown = [], set()
    for name, m in model.named_modules():
        kind = type(m).__name__
        if kind in known:
            found.append(m)
        elif name.endswith(".gate") and hasattr(m, "top_k") and hasattr(m, "weight"):
            unknown.add(kind)
    if unknown:
        raise TrainingError(
            f"routing replay does not know the router {', '.join(sorted(unknown))}; it knows "
            f"{', '.join(sorted(known))}: set trainer.moe.router_replay disabled for this model"
        )
    return found


class RouterReplay:
    """Hooks on every router of `model`. Per forward: `force(ids_TYK)` (or None) replaces the
    routes; `record(True)` keeps the live ids of each layer ([T, K] per layer, `live()`)."""

    def __init__(self, model: torch.nn.Module):
        self.gates = routers(model)
        if not self.gates:
            raise TrainingError(
                "trainer.moe.router_replay / routing metrics need an MoE model; this one has no router"
            )
        top_k = self.gates[0].top_k
        if not isinstance(top_k, int):
            raise TrainingError(
                f"routing replay: {type(self.gates[0]).__name__}.top_k is not an int"
            )
        self.top_k = top_k
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
        weights = _weights()[type(self.gates[layer]).__name__]

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
        live = [x for x in self._live if x is not None]
        if len(live) != len(self._live):
            raise TrainingError("routing replay: a router did not run in the recorded forward")
        return torch.stack(live, dim=1)

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
        # live id also in the reference set
        hit_TYK = (live_TYK[..., :, None] == ref[..., None, :]).any(-1)
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
