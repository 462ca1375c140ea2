"""The optimizer-step machinery both trainers share (single process and expert parallel):
minibatches over a seeded permutation, micro-batches with gradient accumulation, losses
normalized by the whole minibatch's token count on every rank (so the ranks' steps sum to the
single process's), non-finite steps skipped on every rank, and the MoE router hooks (aux loss,
DeepSeek-V3's bias balancing). docs/async.md (the trainer) and docs/expert-parallel.md.

Legend: N = samples, L = packed sequence length, L1 = L - 1, M = rows in a micro-batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from moerl.components.policy_update.loss import (
    importance_weights,
    policy_loss,
    token_logprobs_and_entropy,
)
from moerl.config import RunConfig
from moerl.errors import TrainingError

log = logging.getLogger(__name__)

STAT_KEYS = (
    "loss",
    "clip_fraction",
    "tis_truncated_fraction",
    "dual_clip_fraction",
    "entropy",
    "aux_loss",
    "out_of_support_fraction",
)


@dataclass(frozen=True)
class Packed:
    input_ids_NL: torch.Tensor
    attn_NL: torch.Tensor
    targets_NL1: torch.Tensor
    mask_NL1: torch.Tensor  # 1 where the target is a response token
    engine_logp_NL1: torch.Tensor
    adv_N: torch.Tensor
    # the policy version that sampled each target token (-1 outside responses; `trainer.pack` sets it)
    version_NL1: torch.Tensor | None = None
    routes_NLYK: torch.Tensor | None = (
        None  # the engine's routes (int32, -1: none); None: no sample has any
    )
    is_weight_NL1: torch.Tensor | None = None  # rollout-correction weights (`prepare_correction`)
    is_hit_NL1: torch.Tensor | None = None  # tokens whose weight was truncated or masked

    @property
    def device(self) -> torch.device:
        return self.input_ids_NL.device


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def check_device(where: str, device: torch.device, **tensors: torch.Tensor) -> None:
    """Every tensor handed to the model or to a collective must live on the model's device:
    a CPU tensor reaching NCCL, or a CUDA model fed CPU ids, fails far from its cause."""
    for name, t in tensors.items():
        if t.device != device:
            raise TrainingError(
                f"{where}: {name} is on {t.device}, but the model is on {device}; "
                "this is a moerl bug (a tensor created without device=)"
            )


def sequence_logprobs(
    model,
    p: Packed,
    idx_M: torch.Tensor,
    temperature: float,
    top_k: int = -1,
    top_p: float = 1.0,
    chunk_tokens: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token logprobs and entropies [M, L1] of rows `idx_M`, under the policy as the engine
    samples it (temperature, then top-k/top-p truncation). With `chunk_tokens` > 0 the
    vocabulary projection is never made for more than that many positions at once, in the
    forward or the backward (`ChunkedLogprobHead`)."""
    device = model_device(model)
    check_device("sequence_logprobs", device, input_ids=p.input_ids_NL, rows=idx_M)
    targets = p.targets_NL1[idx_M]
    if chunk_tokens > 0:
        with ChunkedLogprobHead.installed(model, chunk_tokens, targets, temperature, top_k, top_p):
            out = model(input_ids=p.input_ids_NL[idx_M], attention_mask=p.attn_NL[idx_M]).logits
        return out[..., 0], out[..., 1]
    logits = model(input_ids=p.input_ids_NL[idx_M], attention_mask=p.attn_NL[idx_M]).logits
    return token_logprobs_and_entropy(logits[:, :-1], targets, temperature, top_k, top_p)


class ChunkedLogprobHead(torch.nn.Module):
    """Stands in for the model's `lm_head` while the trainer scores the sampled tokens: the
    hidden states of at most `chunk` positions at a time go through the real head, and only
    each position's logprob and entropy leave the chunk, which runs under non-reentrant
    activation checkpointing, so its float32 [chunk, vocabulary] logits are freed at once and
    made again, one chunk at a time, in the backward. Returns [M, L1, 2] (logprob, entropy)
    where the model would return logits; installed inside the model's own forward, so FSDP has
    the head's weight gathered. `installed` swaps it in for one call and back."""

    def __init__(
        self,
        head: torch.nn.Module,
        chunk: int,
        targets_ML1: torch.Tensor,
        temperature: float,
        top_k: int,
        top_p: float,
    ):
        super().__init__()
        self.head, self.chunk, self.targets = head, chunk, targets_ML1
        self.sampling = (temperature, top_k, top_p)

    def _piece(self, h_CH: torch.Tensor, t_C: torch.Tensor) -> torch.Tensor:
        logp, ent = token_logprobs_and_entropy(
            self.head(h_CH).unsqueeze(0), t_C.unsqueeze(0), *self.sampling
        )
        return torch.stack([logp[0], ent[0]], dim=-1)

    def forward(self, h_BLH: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = h_BLH[:, :-1]
        m, l1, hid = h.shape
        flat_TH, flat_T = h.reshape(-1, hid), self.targets.reshape(-1)
        pieces = [
            checkpoint(
                self._piece,
                flat_TH[i : i + self.chunk],
                flat_T[i : i + self.chunk],
                use_reentrant=False,
            )
            for i in range(0, flat_TH.shape[0], self.chunk)
        ]
        return torch.cat(pieces).reshape(m, l1, 2)

    @staticmethod
    @contextmanager
    def installed(model, chunk: int, targets_ML1, temperature: float, top_k: int, top_p: float):
        head = model.get_output_embeddings()
        model.set_output_embeddings(
            ChunkedLogprobHead(head, chunk, targets_ML1, temperature, top_k, top_p)
        )
        try:
            yield
        finally:
            model.set_output_embeddings(head)


def sampled_logprobs(
    model, p: Packed, idx_M: torch.Tensor, cfg: RunConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sequence_logprobs` with the rollout's sampling parameters."""
    r = cfg.rollout
    return sequence_logprobs(
        model,
        p,
        idx_M,
        r.temperature,
        r.top_k,
        r.top_p,
        cfg.trainer.parallelism.logprob_chunk_tokens,
    )


def rows_per_micro_batch(p: Packed, micro_batch_tokens: int, total_rows: int) -> int:
    """Rows of the packed (padded) batch per micro-batch of at most `micro_batch_tokens`
    positions. Cut by rows, not re-packed by length: a batch with one very long sample pays its
    length for every row, and a row longer than the budget is still one micro-batch (logged)."""
    length = p.input_ids_NL.shape[1]
    if micro_batch_tokens == 0:
        return max(total_rows, 1)
    if length > micro_batch_tokens:
        log.warning(
            "one packed sequence (%d positions) is longer than trainer.parallelism.micro_batch_tokens=%d; "
            "micro-batches of one row",
            length,
            micro_batch_tokens,
        )
    return max(1, micro_batch_tokens // length)


def policy_logprobs(
    model, p: Packed, cfg: RunConfig, routing: Routing | None = None
) -> torch.Tensor:
    """Logprobs [N, L1] of every row, in micro-batches, without grad (pi_old)."""
    n = p.input_ids_NL.shape[0]
    out = torch.zeros_like(p.engine_logp_NL1)
    step = rows_per_micro_batch(p, cfg.trainer.parallelism.micro_batch_tokens, n)
    with torch.no_grad():
        for idx in torch.arange(n, device=p.device).split(step):
            with Routing.old_pass(routing, p, idx):
                out[idx] = sampled_logprobs(model, p, idx, cfg)[0]
    return out


class Routing:
    """The trainer's routers during one batch (`replay.py`): forced routes per `trainer.
    router_replay`, live routes recorded in the pi_old pass (R2's routes; the agreement with
    the engine's, whenever the samples carry them)."""

    def __init__(self, model, p: Packed, mode: str):
        from moerl.components.policy_update.replay import Agreement, RouterReplay

        if mode == "R3" and p.routes_NLYK is None:
            log.warning(
                "trainer.moe.router_replay R3: no sample of this batch carries the engine's routes; "
                "every token routes live (moe/replay_forced_fraction = 0)"
            )
        self.mode, self.p = mode, p
        self.replay = RouterReplay(model)
        if p.routes_NLYK is not None and p.routes_NLYK.shape[2:] != (
            self.replay.layers,
            self.replay.top_k,
        ):
            self.replay.close()
            raise TrainingError(
                f"the samples' routed_experts hold {p.routes_NLYK.shape[2]} layers x top-"
                f"{p.routes_NLYK.shape[3]}; the model has {self.replay.layers} MoE layers x top-"
                f"{self.replay.top_k} (routes recorded from another model?)"
            )
        self.r2_NLYK: torch.Tensor | None = None
        if mode == "R2":
            n, length = p.input_ids_NL.shape
            self.r2_NLYK = torch.full(
                (n, length, self.replay.layers, self.replay.top_k),
                -1,
                dtype=torch.int32,
                device=p.device,
            )
        self.agreement = Agreement(self.replay.layers, p.device)

    @classmethod
    def for_batch(cls, model, p: Packed, mode: str) -> Routing | None:
        """The routing hooks this batch needs: with replay, or when its samples carry routes."""
        return cls(model, p, mode) if mode != "disabled" or p.routes_NLYK is not None else None

    def _flat(self, routes_NLYK: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
        return None if routes_NLYK is None else routes_NLYK[idx].reshape(-1, *routes_NLYK.shape[2:])

    @staticmethod
    @contextmanager
    def old_pass(routing: Routing | None, p: Packed, idx: torch.Tensor, counted: bool = True):
        """pi_old's forward of rows `idx`: R3 forces the engine's routes; the live ones are kept.
        `counted` False: a padding micro-batch (expert parallel), run but not measured."""
        if routing is None:
            yield
            return
        r = routing.replay
        r.force(routing._flat(p.routes_NLYK, idx) if routing.mode == "R3" else None)
        r.record(counted)
        try:
            yield
            if counted:
                m, length = p.input_ids_NL[idx].shape
                live = r.live()
                if routing.r2_NLYK is not None:
                    routing.r2_NLYK[idx] = live.reshape(m, length, *live.shape[1:]).to(torch.int32)
                if p.routes_NLYK is not None:
                    routing.agreement.add(
                        live, routing._flat(p.routes_NLYK, idx), p.attn_NL[idx].reshape(-1).bool()
                    )
        finally:
            r.force(None)
            r.record(False)

    @contextmanager
    def train_pass(self, idx: torch.Tensor):
        """An optimizer step's forward and backward of rows `idx`: R2 / R3 force their routes."""
        routes = (
            self.r2_NLYK if self.mode == "R2" else self.p.routes_NLYK if self.mode == "R3" else None
        )
        self.replay.force(self._flat(routes, idx))
        try:
            yield
        finally:
            self.replay.force(None)

    def metrics(self, distributed: bool = False) -> dict[str, float]:
        from moerl.components.policy_update.replay import Agreement

        flat = torch.cat(
            [
                self.agreement.flat(),
                torch.tensor(
                    [float(self.replay.replaced), float(self.replay.forced_slots)],
                    dtype=torch.float64,
                    device=self.p.device,
                ),
            ]
        )
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(flat)
        replaced, forced = float(flat[-2]), float(flat[-1])
        out = Agreement.metrics(flat[:-2], self.replay.layers)
        out["moe/router_replay"] = {"disabled": 0.0, "R2": 2.0, "R3": 3.0}[self.mode]
        if self.mode == "R3":
            slots = float(self.p.attn_NL.sum()) * self.replay.layers
            # every row is counted on one rank
            out["moe/replay_forced_fraction"] = forced / max(slots, 1.0)
            out["moe/replay_replaced_fraction"] = replaced / max(forced, 1.0)
        return out

    def close(self) -> None:
        self.replay.close()


def optimizer_steps(cfg: RunConfig, n: int) -> int:
    """Optimizer steps for a batch of `n` samples: `trainer.optimizer.optimizer_steps_per_iteration`; with
    dynamic sampling (`buffer.min_signal_groups`) that many for a full batch of min_signal_groups
    x G samples and proportionally fewer (at least one) for a batch short of it, so every step
    has the same size whatever the batch."""
    steps, full = cfg.trainer.optimizer.optimizer_steps_per_iteration, cfg.buffer.min_signal_groups
    if full is None or n <= 0:
        return steps
    return max(1, min(steps, round(steps * n / (full * cfg.rollout.samples_per_prompt))))


def minibatches(
    n: int, steps: int, seed: int, world: int, device: torch.device
) -> list[torch.Tensor]:
    """Exactly min(steps, n // world) minibatches (sizes differ by at most one) over a seeded
    permutation; `torch.chunk` would return fewer than asked for some n."""
    k = min(steps, n // world)
    if k < 1:
        return []
    perm = torch.randperm(
        n, generator=torch.Generator(device="cpu").manual_seed(seed), device="cpu"
    )
    return [c.to(device) for c in torch.tensor_split(perm, k)]


def micro_parts(
    chunk: torch.Tensor, rank: int, world: int, rows_per: int
) -> list[tuple[torch.Tensor, bool]]:
    """This rank's rows of `chunk`, cut into as many micro-batches as the largest share needs.
    A rank with fewer rows than that gets padding parts: (one of its rows, True) whose loss
    is masked out, so that it still joins every collective."""
    mine = chunk[rank::world]
    largest = math.ceil(len(chunk) / world)
    n_micro = math.ceil(largest / rows_per)
    parts = []
    for part in torch.tensor_split(mine, n_micro):
        parts.append((part, False) if len(part) else (mine[:1], True))
    return parts


def accumulate(
    model,
    p: Packed,
    parts: list[tuple[torch.Tensor, bool]],
    old_logp_NL1: torch.Tensor,
    cfg: RunConfig,
    n_tokens: float,
    n_rows: int,
    aux_fn: Callable[[], torch.Tensor | None] | None = None,
    n_seqs: float | None = None,
    routing: Routing | None = None,
) -> dict[str, float]:
    """Forward and backward every micro-batch in `parts`; gradients accumulate in the model.

    `n_tokens` / `n_rows`: response tokens / rows of the whole minibatch (every rank). The
    router aux loss of a micro-batch (a mean over its tokens) is weighted by its share of rows.
    Returns this rank's share of the minibatch statistics (they sum over ranks)."""
    tc = cfg.trainer
    sums = dict.fromkeys(STAT_KEYS, 0.0)
    for idx, padding in parts:
        mask = torch.zeros_like(p.mask_NL1[idx]) if padding else p.mask_NL1[idx]
        # A token that top-k/top-p truncation gives probability 0 under pi_old (a stale sample,
        # or a numerical tie with the engine) has no ratio and no gradient: leave it out, counted.
        outside = mask.bool() & ~torch.isfinite(old_logp_NL1[idx])
        mask = torch.where(outside, torch.zeros_like(mask), mask)
        sums["out_of_support_fraction"] += float(outside.sum()) / max(n_tokens, 1.0)
        if p.is_weight_NL1 is None or p.is_hit_NL1 is None:
            raise TrainingError(
                "accumulate: the batch has no importance weights (a moerl bug: call "
                "prepare_correction after pi_old)"
            )
        w, hit = p.is_weight_NL1[idx], p.is_hit_NL1[idx]
        with routing.train_pass(idx) if routing is not None else nullcontext():
            logp, entropy = sampled_logprobs(model, p, idx, cfg)
            loss, stats = policy_loss(
                logp,
                old_logp_NL1[idx],
                w,
                p.adv_N[idx],
                mask,
                *tc.loss.clip_range,
                kind=tc.loss.policy_loss,
                agg=tc.loss.resolved.loss_agg_mode,
                n_tokens=n_tokens,
                n_seqs=n_rows if n_seqs is None else n_seqs,
                clip_ratio_c=tc.loss.clip_ratio_c,
            )
            aux = aux_fn() if aux_fn is not None else None
            if aux is not None:
                aux = aux * (0.0 if padding else len(idx) / n_rows)
                loss = loss + aux
                sums["aux_loss"] += float(aux.detach())
            loss.backward()
        sums["loss"] += stats.loss
        sums["clip_fraction"] += stats.clip_fraction
        sums["tis_truncated_fraction"] += float((hit & mask.bool()).sum()) / max(n_tokens, 1.0)
        sums["dual_clip_fraction"] += stats.dual_clip_fraction
        ent = torch.where(mask.bool(), entropy.detach(), torch.zeros_like(entropy))
        sums["entropy"] += float(ent.sum()) / max(n_tokens, 1.0)
    return sums


def logprob_mismatch_sum(
    old_logp_NL1: torch.Tensor, engine_logp_NL1: torch.Tensor, mask_NL1: torch.Tensor
) -> float:
    """Sum of |trainer - engine| logprob over response tokens inside the trainer's support."""
    keep = mask_NL1.bool() & torch.isfinite(old_logp_NL1)
    diff = torch.where(keep, (old_logp_NL1 - engine_logp_NL1).abs(), torch.zeros_like(old_logp_NL1))
    return float(diff.sum())


def losses_are_finite(stats: dict[str, float]) -> bool:
    return all(math.isfinite(v) for v in stats.values())


def finish_step(
    opt,
    counters,
    cfg: RunConfig,
    stats: dict[str, float],
    sums: dict[str, float],
    grad_norm: float,
    losses_finite: bool,
    norm_share: float = 1.0,
) -> bool:
    """Take the optimizer step and add this rank's statistics to `sums`, or, when any loss or
    the (global) gradient norm is not finite, drop the gradients and count a skipped step.
    `norm_share`: the fraction of the global norm this rank adds (ranks' shares sum to it)."""
    if not losses_finite or not math.isfinite(grad_norm):
        opt.zero_grad(set_to_none=True)
        count_skip(counters, cfg, f"non-finite {'gradient' if losses_finite else 'loss'}")
        return False
    opt.step()
    counters.consecutive_skipped = 0
    counters.step += 1
    for k, v in stats.items():
        sums[k] += v
    sums["grad_norm"] += grad_norm * norm_share
    return True


def count_skip(counters, cfg: RunConfig, why: str) -> None:
    """Count a skipped step; too many in a row fail the run (the weights are not moving)."""
    counters.consecutive_skipped += 1
    counters.skipped_total += 1
    log.warning(
        "%s at step %d: skipped (%d in a row)", why, counters.step, counters.consecutive_skipped
    )
    limit = cfg.trainer.optimizer.max_consecutive_skipped_steps
    if counters.consecutive_skipped >= limit:
        raise TrainingError(
            f"policy_update: {counters.consecutive_skipped} optimizer steps in a row had a non-finite loss or gradient "
            f"(trainer.optimizer.max_consecutive_skipped_steps={limit}); lower trainer.optimizer.learning_rate or check the batch "
            "for bad logprobs"
        )


class RouterAux:
    """The load-balancing aux loss of the single-process trainer: forward hooks on every MoE
    router capture (router_logits, top-k ids) and `__call__` returns the same loss the expert-
    parallel block computes (`ep_moe.load_balancing_loss`, summed over layers, times the coef)."""

    def __init__(self, model, coef: float):
        from moerl.components.policy_update.ep_moe import sparse_blocks

        self.coef = coef
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._handles = [
            block.gate.register_forward_hook(self._hook) for _, _, block in sparse_blocks(model)
        ]
        if not self._handles:
            raise TrainingError(
                "trainer.moe.aux_loss_coef > 0 but the model has no MoE router to balance"
            )

    def _hook(self, module, args, output) -> None:
        router_logits_TE, _, idx_TK = output
        self._seen.append((router_logits_TE, idx_TK))

    def __call__(self) -> torch.Tensor | None:
        from moerl.components.policy_update.ep_moe import load_balancing_loss

        seen, self._seen = self._seen, []
        return self.coef * sum(load_balancing_loss(lg, ix) for lg, ix in seen) if seen else None

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class RouterBias:
    """DeepSeek-V3's auxiliary-loss-free load balancing (arXiv 2412.19437, section 2.1.2): a
    sigmoid router chooses experts by score + `e_score_correction_bias`, and after every
    optimizer step each expert's bias moves by `rate` towards balance: down if the expert
    received more than the mean load over the step's tokens, up if less
    (b_i += rate * sign(mean - load_i)). The bias only steers the choice; the gate weights use
    the unbiased scores, so no gradient flows through it.

    Forward hooks on every bias-corrected router count the experts chosen in training forwards
    (the pi_old pass runs in eval mode and is not counted; activation checkpointing's recompute
    counts every token twice, which the sign ignores). `step(group)` sums the counts over the
    ranks (each rank routes its own tokens) so that every rank moves its copy of the bias the
    same way. Deviation: DeepSeek-V3 updates once per batch of its pre-training; moerl does it
    once per optimizer step, the same cadence as Megatron's `moe_router_bias_update_rate`."""

    def __init__(self, model, rate: float):
        from moerl.models.families import router_bias_names

        names = router_bias_names()  # the bias-correction buffers the families' routers carry
        found: dict[int, tuple[torch.nn.Module, str]] = {}
        for m in model.modules():
            gate = getattr(m, "gate", None)
            name = next((n for n in names if hasattr(gate, n)), None)
            if isinstance(gate, torch.nn.Module) and name is not None:
                found[id(gate)] = (gate, name)
        routers = [g for g, _ in found.values()]
        if not routers:
            raise TrainingError(
                f"trainer.moe.router_bias_update_rate {rate}: {type(model).__name__} has no router with a "
                "bias correction (DeepSeek-V3's e_score_correction_bias); balance it with "
                "trainer.moe.aux_loss_coef, or set the rate to 0"
            )
        self.rate, self.routers = rate, routers
        self._bias_names = [n for _, n in found.values()]  # read at each step: buffers may move
        bias = getattr(routers[0], self._bias_names[0])
        self.load_RE = torch.zeros(
            len(routers), bias.numel(), dtype=torch.float64, device=bias.device
        )
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]

    def _hook(self, i: int):
        def count(module, args, output) -> None:
            if module.training:
                idx = output[2].detach().reshape(-1)
                self.load_RE[i] += torch.bincount(idx, minlength=self.load_RE.shape[1]).to(
                    self.load_RE
                )

        return count

    def step(self, sum_over_ranks: bool = False) -> dict[str, float]:
        """Move every bias one step towards balance; returns the step's load statistics."""
        import torch.distributed as dist

        load = self.load_RE
        if sum_over_ranks:
            dist.all_reduce(load)
        mean = load.mean(dim=1, keepdim=True)
        with torch.no_grad():
            for r, n, row, m in zip(self.routers, self._bias_names, load, mean):
                b = getattr(r, n)
                b.add_((self.rate * torch.sign(m - row)).to(b))
        ratio = float((load.max(dim=1).values / mean.squeeze(1).clamp_min(1e-9)).mean())
        self.load_RE.zero_()
        return {"moe/router_max_load_ratio": ratio}

    def reset(self) -> None:
        """A skipped step: its counts are dropped with its gradients."""
        self.load_RE.zero_()

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def prepare_correction(
    p: Packed,
    old_logp_NL1: torch.Tensor,
    cfg: RunConfig,
    trainer_version: int,
    rows: torch.Tensor | None = None,
    distributed: bool = False,
) -> tuple[Packed, dict[str, float]]:
    """After pi_old, before any step: the `rollout_corr/*` metrics of this batch, the geometric
    sequence rejection (removed from the mask, so from every normalizer) and the importance
    weights of `trainer.correction.tis_mode`. `rows`: the rows whose pi_old this rank computed (expert
    parallel: its share; the others are not valid here); `distributed`: sum over the ranks,
    which every rank then applies alike."""
    from dataclasses import replace

    from moerl.components.policy_update.correction import (
        correction_sums,
        finish,
        geometric_rejection,
    )

    tc = cfg.trainer
    n = p.input_ids_NL.shape[0]
    rows = torch.arange(n, device=p.device) if rows is None else rows
    if p.version_NL1 is None:
        raise TrainingError(
            "prepare_correction: the batch has no token versions (a moerl bug: pack it)"
        )
    # tokens the trainer's own version sampled (in-flight updates: per token)
    own = p.version_NL1 == trainer_version
    c = correction_sums(
        old_logp_NL1[rows],
        p.engine_logp_NL1[rows],
        p.mask_NL1[rows],
        own[rows],
        tc.correction.extreme_ratio_tau,
    )
    if distributed:
        c = c.all_reduce()
    metrics = finish(c)
    mask = p.mask_NL1
    if tc.correction.rollout_rs == "geometric":
        lower, upper = tc.correction.rs_bounds
        drop = torch.zeros(n, dtype=torch.float64, device=p.device)
        drop[rows] = geometric_rejection(
            old_logp_NL1[rows], p.engine_logp_NL1[rows], mask[rows], upper, lower
        ).double()
        tokens = torch.stack(
            [(mask.sum(-1).double() * drop)[rows].sum(), mask[rows].double().sum()]
        )
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(drop)
            dist.all_reduce(tokens)
        mask = torch.where(drop[:, None] > 0, torch.zeros_like(mask), mask)
        metrics["rollout_corr/rs_masked_fraction"] = float(tokens[0] / tokens[1].clamp_min(1.0))
        metrics["rollout_corr/rs_masked_sequences"] = float(drop.sum())
    usable = mask.bool() & torch.isfinite(old_logp_NL1)
    iw = importance_weights(
        old_logp_NL1,
        p.engine_logp_NL1,
        usable,
        tc.correction.tis_mode,
        tc.correction.tis_cap,
        tc.correction.tis_mask_low,
    )
    return replace(p, mask_NL1=mask, is_weight_NL1=iw.w_BT, is_hit_NL1=iw.hit_BT), metrics
