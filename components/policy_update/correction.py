"""Rollout correction: how far the engine's behaviour policy mu is from the trainer's pi_old on
one batch, and the sequence rejection that drops samples too far off.

Legend: N = samples, L1 = next-token positions, r_t = log pi_old(a_t) - log mu(a_t) at a real
response token, rho_t = exp(r_t).

The metrics and their formulas, the clamp and the rejection:
docs/async.md#componentspolicy_updatecorrectionpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moerl.components.policy_update.loss import LOG_RATIO_BOUND

TAU = 2.0
# sums: token-level then sequence-level; maxes: |r| max, rho max, -rho min (a max of negatives)
SUM_KEYS = (
    "tokens",
    "neg_r",
    "k3",
    "rho",
    "rho2",
    "abs_r",
    "extreme_high",
    "extreme_low",
    "seqs",
    "seq_rho2",
)
MAX_KEYS = ("abs_r_max", "rho_max", "neg_rho_min")
SPLITS = ("all", "own", "stale")


@dataclass
class CorrectionSums:
    """Per split (`all`, `own`, `stale`): sums [len(SUM_KEYS)] and maxes [len(MAX_KEYS)], float64."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)

    def flat(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([self.sums[s] for s in SPLITS]), torch.cat([self.maxes[s] for s in SPLITS])

    @classmethod
    def from_flat(cls, sums: torch.Tensor, maxes: torch.Tensor) -> CorrectionSums:
        ns, nm = len(SUM_KEYS), len(MAX_KEYS)
        return cls(
            {s: sums[i * ns : (i + 1) * ns] for i, s in enumerate(SPLITS)},
            {s: maxes[i * nm : (i + 1) * nm] for i, s in enumerate(SPLITS)},
        )

    def all_reduce(self) -> CorrectionSums:
        """Sum (and max) over every rank of the default process group."""
        import torch.distributed as dist

        sums, maxes = self.flat()
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return CorrectionSums.from_flat(sums, maxes)


def correction_sums(
    old_logp_NL1: torch.Tensor,
    engine_logp_NL1: torch.Tensor,
    mask_NL1: torch.Tensor,
    own: torch.Tensor,
    tau: float = TAU,
) -> CorrectionSums:
    """The sums behind every `rollout_corr/*` metric of these rows. `own`: the tokens ([N, L-1])
    or samples ([N]) the trainer's own version sampled (the "own" split; the rest are "stale").
    Tokens outside pi_old's support (a -inf logprob: top-k/top-p truncation) are left out, as
    in the loss."""
    real = mask_NL1.bool() & torch.isfinite(old_logp_NL1) & torch.isfinite(engine_logp_NL1)
    zero = torch.zeros_like(old_logp_NL1, dtype=torch.float64)
    r = torch.where(real, (old_logp_NL1.double() - engine_logp_NL1.double()), zero)
    r = r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = torch.where(real, r.exp(), zero)
    out = CorrectionSums()
    device = old_logp_NL1.device
    own_NL1 = (own if own.dim() == 2 else own[:, None].expand_as(real)).bool()
    for split, sel in (("all", torch.ones_like(own_NL1)), ("own", own_NL1), ("stale", ~own_NL1)):
        m = real & sel
        mf = m.double()
        has = m.any(-1)
        seq_log = torch.where(has, (r * mf).sum(-1), torch.zeros_like(has, dtype=torch.float64))
        k3 = (rho - r - 1.0) * mf
        out.sums[split] = torch.stack(
            [
                mf.sum(),
                (-r * mf).sum(),
                k3.sum(),
                (rho * mf).sum(),
                (rho.square() * mf).sum(),
                (r.abs() * mf).sum(),
                ((rho > tau) & m).double().sum(),
                ((rho < 1.0 / tau) & m).double().sum(),
                has.double().sum(),
                torch.where(
                    has,
                    (2.0 * seq_log).clamp(max=2 * LOG_RATIO_BOUND).exp(),
                    torch.zeros_like(seq_log),
                ).sum(),
            ]
        ).to(device)
        neg_inf = torch.tensor(-math.inf, dtype=torch.float64, device=device)
        out.maxes[split] = torch.stack(
            [
                torch.where(m, r.abs(), neg_inf).max() if m.any() else neg_inf,
                torch.where(m, rho, neg_inf).max() if m.any() else neg_inf,
                torch.where(m, -rho, neg_inf).max() if m.any() else neg_inf,
            ]
        )
    return out


def finish(c: CorrectionSums, prefix: str = "rollout_corr/") -> dict[str, float]:
    """Metrics from (reduced) sums. A split without tokens logs only its token count."""
    out: dict[str, float] = {}
    for split in SPLITS:
        s = dict(zip(SUM_KEYS, c.sums[split].tolist()))
        mx = dict(zip(MAX_KEYS, c.maxes[split].tolist()))
        pre = prefix if split == "all" else f"{prefix}{split}/"
        out[f"{pre}tokens"] = s["tokens"]
        if s["tokens"] == 0:
            continue
        n = s["tokens"]
        out.update(
            {
                f"{pre}kl": s["neg_r"] / n,
                f"{pre}k3_kl": s["k3"] / n,
                f"{pre}chi2_token": s["rho2"] / n - 1.0,
                f"{pre}chi2_seq": s["seq_rho2"] / max(s["seqs"], 1.0) - 1.0,
                f"{pre}is_ess": (s["rho"] / n) ** 2 / max(s["rho2"] / n, 1e-300),
                f"{pre}log_ratio_abs_mean": s["abs_r"] / n,
                f"{pre}log_ratio_abs_max": mx["abs_r_max"],
                f"{pre}ratio_max": mx["rho_max"],
                f"{pre}ratio_min": -mx["neg_rho_min"],
                f"{pre}extreme_high_fraction": s["extreme_high"] / n,
                f"{pre}extreme_low_fraction": s["extreme_low"] / n,
                f"{pre}extreme_fraction": (s["extreme_high"] + s["extreme_low"]) / n,
            }
        )
    total = c.sums["all"][0].item()
    out[f"{prefix}stale_token_fraction"] = c.sums["stale"][0].item() / total if total else 0.0
    return out


def geometric_rejection(
    old_logp_NL1: torch.Tensor,
    engine_logp_NL1: torch.Tensor,
    mask_NL1: torch.Tensor,
    upper: float,
    lower: float,
) -> torch.Tensor:
    """[N] True for a sequence to drop: its geometric-mean ratio exp(mean_t r_t) over real,
    in-support tokens is outside [lower, upper]. A sequence without such tokens is kept."""
    real = mask_NL1.bool() & torch.isfinite(old_logp_NL1) & torch.isfinite(engine_logp_NL1)
    r = torch.where(
        real,
        old_logp_NL1.double() - engine_logp_NL1.double(),
        torch.zeros_like(old_logp_NL1, dtype=torch.float64),
    )
    n = real.sum(-1)
    geo = torch.exp((r.sum(-1) / n.clamp_min(1)).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return (n > 0) & ((geo > upper) | (geo < lower))
