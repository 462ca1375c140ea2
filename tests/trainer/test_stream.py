"""The streamed async trainer (`trainer.schedule.stream`, components/policy_update/streamed.py `Streamed`,
ep_train `train_ep(pi_old=...)`, mesh `step` / `save`): where it is on and what refuses it,
minibatches cut from the gather as groups arrive on a real Valkey, and one streamed step on a
real tiny Qwen3-MoE equal to the whole-batch step when the engine's logprobs are the trainer's
own pi_old (and not equal when they are another policy's)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from moerl.components.policy_update.gather import (
    Inbox,
    Issuer,
    TrainerState,
    gather,
    stream_chunk,
)
from moerl.components.policy_update.streamed import merge_steps
from moerl.config import load_config, parse_config
from moerl.errors import ConfigError
from moerl.records import ScoredSample, TrainSample
from tests.support.valkey_server import server, stage_bus  # noqa: F401 (server: a module fixture)
from tests.trainer.test_trainer_gather import scored_group

ROOT = Path(__file__).resolve().parents[2]
EMBEDDED = ROOT / "configs/tiny-moe-grpo.yaml"


# -- where it is on ----------------------------------------------------------------------------
def test_the_embedded_async_default_streams_and_splits_the_cores():
    cfg = load_config(EMBEDDED, mode="async")
    assert cfg.buffer.max_staleness == 0 and cfg.trainer.schedule.stream is None
    assert (
        cfg.resolved.stream and cfg.resolved.local_cores == "split"
    )  # the engine and the trainer work at once
    # the same run asked not to: each version once its batch is in, the stages taking turns
    off = load_config(EMBEDDED, ["trainer.schedule.stream=false"], mode="async")
    assert not off.resolved.stream and off.resolved.local_cores == "shared"
    # staleness 1: the whole batch, one version behind, on a core each
    behind = load_config(EMBEDDED, ["buffer.max_staleness=1"], mode="async")
    assert not behind.resolved.stream and behind.resolved.local_cores == "split"
    assert not load_config(EMBEDDED).resolved.stream  # the sync pipeline never streams


@pytest.mark.parametrize(
    ("sets", "named"),
    [
        (["buffer.max_staleness=1"], "buffer.max_staleness 1"),
        (["buffer.min_signal_groups=8"], "buffer.min_signal_groups 8"),
        (
            ["trainer.parallelism.persistent_ranks=false"],
            "trainer.parallelism.persistent_ranks false",
        ),
    ],
)
def test_stream_true_where_it_cannot_is_refused_naming_the_key(sets, named):
    with pytest.raises(ConfigError, match=f"trainer.schedule.stream: true cannot run with {named}"):
        load_config(EMBEDDED, ["trainer.schedule.stream=true", *sets], mode="async")
    # null: the run does not stream, and says nothing
    assert not load_config(EMBEDDED, sets, mode="async").resolved.stream


def test_pi_old_is_the_engines_only_where_it_agrees_with_the_trainers():
    cpu = load_config(EMBEDDED, mode="async")
    assert cpu.rollout.resolved.dtype == cpu.model.dtype == "float32"
    assert cpu.resolved.stream_pi_old == "engine"
    # bf16 serving (a GPU's default), or a rejection that needs a ratio: the trainer's own
    assert load_config(
        EMBEDDED, ["rollout.dtype=bfloat16"], mode="async"
    ).resolved.stream_pi_old == ("proximal")
    rs = ["trainer.correction.rollout_rs=geometric"]
    assert load_config(EMBEDDED, rs, mode="async").resolved.stream_pi_old == "proximal"
    with pytest.raises(ConfigError, match="stream_pi_old engine with rollout_rs geometric"):
        load_config(EMBEDDED, [*rs, "trainer.correction.stream_pi_old=engine"], mode="async")
    forced = ["trainer.correction.stream_pi_old=proximal"]
    assert load_config(EMBEDDED, forced, mode="async").resolved.stream_pi_old == "proximal"
    # quantized or bf16-cast trainers do not agree with the engine either
    for cast in (
        ["trainer.parallelism.mixed_precision=bf16"],
        ["rollout.device=cuda", "rollout.dtype=float32", "rollout.quantization=fp8"],
    ):
        c = load_config(EMBEDDED, cast, mode="async")
        assert c.rollout.resolved.dtype == "float32" and c.resolved.stream_pi_old == "proximal", (
            cast
        )
    # the setting means nothing where the run does not stream: not refused there
    load_config(EMBEDDED, [*rs, "trainer.correction.stream_pi_old=engine"])
    # R2 needs a pi_old pass: refused only with the engine's logprobs
    r2 = ["trainer.moe.router_replay=R2", "trainer.schedule.stream=true"]
    with pytest.raises(ConfigError, match="trainer.moe.router_replay R2"):
        load_config(EMBEDDED, r2, mode="async")
    assert load_config(EMBEDDED, [*r2, *forced], mode="async").resolved.stream


def test_stream_true_in_the_sync_pipeline_is_refused():
    with pytest.raises(
        ConfigError, match="trainer.schedule.stream: true cannot run with pipeline.mode sync"
    ):
        load_config(EMBEDDED, ["trainer.schedule.stream=true"])


def test_a_version_is_cut_into_its_optimizer_steps():
    cfg = parse_config(
        {
            "task": {"prompts_per_iteration": 512},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 32}},
        }
    )
    assert stream_chunk(cfg) == 16
    odd = parse_config(
        {
            "task": {"prompts_per_iteration": 10},
            "trainer": {"optimizer": {"optimizer_steps_per_iteration": 4}},
        }
    )
    assert stream_chunk(odd) == 3  # 3 + 3 + 3 + 1: never more steps than asked


def test_merged_metrics_sum_counts_and_average_the_rest():
    steps = [
        {
            "train/steps": 1.0,
            "train/skipped_steps": 0.0,
            "train/tokens": 10.0,
            "train/loss": 1.0,
            "train/empty_batch": 0.0,
            "train/logprob_mismatch": 0.0,
            "rollout_corr/x": 1.0,
            "moe/tokens_expert_0": 4.0,
        },
        {"train/steps": 0.0, "train/skipped_steps": 0.0, "train/empty_batch": 1.0},
        {
            "train/steps": 1.0,
            "train/skipped_steps": 1.0,
            "train/tokens": 30.0,
            "train/loss": 3.0,
            "train/empty_batch": 0.0,
            "moe/tokens_expert_0": 6.0,
        },
    ]
    m = merge_steps(steps)
    assert m["trainer/streamed_minibatches"] == 3
    assert (m["train/steps"], m["train/skipped_steps"], m["train/tokens"]) == (2.0, 1.0, 40.0)
    assert m["train/loss"] == 2.0  # over the minibatches that stepped
    assert m["moe/tokens_expert_0"] == 6.0  # the last step's, as the whole-batch path logs
    assert m["train/empty_batch"] == 0.0
    # pi_old is the engine's: a mismatch against it would read 0 and mean nothing
    assert "train/logprob_mismatch" not in m and "rollout_corr/x" not in m
    assert merge_steps([steps[1]])["train/empty_batch"] == 1.0
    # proximal: the mismatch is measured, each statistic reduced as over steps
    corr = [
        {
            "train/steps": 1.0,
            "train/empty_batch": 0.0,
            "rollout_corr/tokens": 10.0,
            "rollout_corr/kl": 0.1,
            "rollout_corr/ratio_max": 1.5,
            "rollout_corr/ratio_min": 0.9,
            "rollout_corr/rs_masked_sequences": 1.0,
        },
        {
            "train/steps": 1.0,
            "train/empty_batch": 0.0,
            "rollout_corr/tokens": 30.0,
            "rollout_corr/kl": 0.5,
            "rollout_corr/ratio_max": 1.2,
            "rollout_corr/ratio_min": 0.7,
            "rollout_corr/rs_masked_sequences": 2.0,
        },
    ]
    m = merge_steps(corr, engine_pi_old=False)
    assert m["rollout_corr/tokens"] == 40.0 and m["rollout_corr/rs_masked_sequences"] == 3.0
    assert m["rollout_corr/ratio_max"] == 1.5 and m["rollout_corr/ratio_min"] == 0.7
    assert m["rollout_corr/kl"] == pytest.approx((0.1 * 10 + 0.5 * 30) / 40)  # by tokens


# -- the gather hands out minibatches as groups arrive (real Valkey) ---------------------------
@pytest.fixture
def bus(server, request, monkeypatch):
    return stage_bus(server, request, monkeypatch, visibility_timeout_s=30)


def test_the_gather_trains_each_chunk_of_groups_as_it_is_taken(bus):
    cfg = load_config(
        EMBEDDED,
        [
            "task.prompts_per_iteration=5",
            "rollout.samples_per_prompt=2",
            "trainer.optimizer.optimizer_steps_per_iteration=2",
            "pipeline.versions=2",
        ],
        mode="async",
    )
    assert cfg.resolved.stream and stream_chunk(cfg) == 3
    # arrival order p0..p4; p1 has no reward variance (no signal: taken, not trained)
    rewards = [[0.0, 1.0], [1.0, 1.0], [0.0, 0.5], [1.0, 0.0], [0.2, 0.1]]
    for i, r in enumerate(rewards):
        scored_group(bus, i, r)
    epoch = bus.claim_trainer("t")
    issuer = Issuer(cfg, bus, TrainerState(version=0, committed=0), epoch, period_s=3600)
    issuer.start()
    calls: list[list[str]] = []

    def on_chunk(groups):
        calls.append([g[0].prompt_id for g in groups])

    try:
        batch, _ = gather(bus, cfg, 0, Inbox(bus), epoch, issuer, on_chunk=on_chunk)
    finally:
        issuer.stop_event.set()
    assert batch.n_groups == 5 and len(batch.used) == 4
    assert calls == [["p0", "p2"], ["p3", "p4"]]  # 3 groups, then the last 2; p1 filtered


# -- one streamed step against the whole-batch step, on a real tiny model ----------------------
CFG = parse_config(
    {
        "trainer": {
            "optimizer": {"optimizer_steps_per_iteration": 1, "learning_rate": 0.01},
            "parallelism": {"micro_batch_tokens": 24},
        }
    }
)


def _samples(n: int = 8) -> list[TrainSample]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        plen, rlen = 3 + i % 2, 2 + i % 3
        ids = torch.randint(5, 20, (plen + rlen,), generator=g).tolist()
        out.append(
            TrainSample(
                prompt_token_ids=ids[:plen],
                response_token_ids=ids[plen:],
                response_logprobs=[-1.0] * rlen,
                advantage=(1.0 + i / 4) * (-1) ** i,
                policy_version=0,
            )
        )
    return out


def _with_logprobs(model, batch: list[TrainSample], shift: float) -> list[TrainSample]:
    """`batch` with the model's own sampled logprobs (+ `shift`) as the engine's."""
    from moerl.components.policy_update.steps import model_device, policy_logprobs
    from moerl.components.policy_update.trainer import pack

    model.eval()
    p = pack(batch, model.config.pad_token_id or 0, model_device(model))
    lp = policy_logprobs(model, p, CFG)
    out = []
    for i, s in enumerate(batch):
        mine = lp[i][p.mask_NL1[i].bool()].tolist()
        assert len(mine) == len(s.response_token_ids) and all(map(math.isfinite, mine))
        out.append(s.model_copy(update={"response_logprobs": [v + shift for v in mine]}))
    return out


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_streamed_step_on_its_own_pi_old_is_the_whole_batch_step(tmp_path):
    from moerl.components.policy_update.ep_train import (
        Session,
        one_rank,
        save_version,
        train_steps,
    )
    from moerl.models.tiny import build_tiny_model

    build_tiny_model(CFG.model.tiny, tmp_path / "s0")
    with one_rank(CFG):
        ref = Session.load(CFG, tmp_path / "s0")
        w0 = _weights(ref.model)
        batch = _with_logprobs(ref.model, _samples(), 0.0)
        far = _with_logprobs(ref.model, _samples(), -0.7)  # another policy's logprobs
        m_ref = train_steps(CFG, ref, batch, seed=5)  # pi_old pass, one step
        w_ref = _weights(ref.model)
        runs = {}
        for name, b in (("own", batch), ("far", far)):
            s = Session.load(CFG, tmp_path / "s0")
            m = train_steps(CFG, s, b, seed=5, pi_old="engine")  # pi_old: the samples' logprobs
            runs[name] = (m, _weights(s.model), s)
        # proximal: pi_old is the trainer's own before the step, whatever the engine's say; the
        # engine's only weigh the tokens (truncated IS), as in the whole-batch step
        whole_far = Session.load(CFG, tmp_path / "s0")
        train_steps(CFG, whole_far, far, seed=5)
        s = Session.load(CFG, tmp_path / "s0")
        m_prox = train_steps(CFG, s, far, seed=5, pi_old="proximal")
        runs["proximal"] = (m_prox, _weights(s.model), s)
        w_whole_far = _weights(whole_far.model)
        # the streamed version is written like any other: its files, its counters moved on
        save_version(CFG, runs["own"][2], tmp_path / "s1")
    assert m_ref["train/steps"] == 1 and runs["own"][0]["train/steps"] == 1
    assert runs["own"][0]["train/loss"] == pytest.approx(m_ref["train/loss"], rel=1e-5, abs=1e-7)
    moved = sum(float((w_ref[k] - w0[k]).norm()) for k in w0)
    gap = {n: sum(float((w[k] - w_ref[k]).norm()) for k in w0) for n, (_, w, _) in runs.items()}
    assert moved > 0
    assert gap["own"] <= 1e-3 * moved, gap  # the same step
    assert gap["far"] > 0.05 * moved, gap  # pi_old is what it was given: this test can fail
    prox_gap = sum(float((runs["proximal"][1][k] - w_whole_far[k]).norm()) for k in w0)
    assert prox_gap <= 1e-3 * moved, prox_gap
    # measured against its own pass: the 0.7 the engine's logprobs were shifted by; with the
    # engine's as pi_old there is nothing to measure
    assert runs["proximal"][0]["train/logprob_mismatch"] == pytest.approx(0.7, abs=1e-3)
    assert runs["own"][0]["train/logprob_mismatch"] == 0.0
    assert runs["own"][2].counters.version == 1 and runs["own"][2].counters.step == 1
    assert (tmp_path / "s1" / "trainer" / "state.json").is_file()
    assert list((tmp_path / "s1").glob("model-r*.safetensors"))


def test_a_failed_publisher_ends_the_gather_at_once(bus):
    """Streamed, the next version's prompts wait for its publication: a failed publisher must
    end the wait, not leave it to the stall watchdog (30 minutes by default)."""
    from moerl.errors import CheckpointError

    cfg = load_config(EMBEDDED, ["task.prompts_per_iteration=4"], mode="async")
    epoch = bus.claim_trainer("t")
    issuer = Issuer(cfg, bus, TrainerState(version=0, committed=0), epoch, period_s=3600)
    issuer.start()

    def failed() -> None:
        raise CheckpointError("version 1: the cache tier refused the put")

    t0 = time.monotonic()
    try:
        with pytest.raises(CheckpointError, match="cache tier refused"):
            gather(bus, cfg, 0, Inbox(bus), epoch, issuer, check=failed)
    finally:
        issuer.stop_event.set()
    assert time.monotonic() - t0 < 10


def test_an_empty_minibatch_sends_the_ranks_nothing():
    """A minibatch with fewer samples than ranks trains nothing: no `step` command (its only
    collective would be the broadcast, which does not hold rank 0 back on NCCL)."""
    from moerl.components.policy_update.ep_train import one_rank
    from moerl.components.policy_update.mesh import Control, Leader

    with one_rank(CFG) as store:
        leader = Leader(CFG, Control(store, 0, 1), "run-x", nodes=1)
        try:
            m = leader.train_step([], 0, 0, "engine")
            assert m == {"train/steps": 0.0, "train/skipped_steps": 0.0, "train/empty_batch": 1.0}
            assert leader.control.seq == 0  # nothing posted
        finally:
            leader.stop()


class _Ranks:
    """A stand-in for the mesh's rank 0 (pure logic: what `Streamed` hands it)."""

    def __init__(self, world: int) -> None:
        self.control = type("C", (), {"world": world})()
        self.sent: list[int] = []

    def train_step(self, samples, version, index, pi_old):
        self.sent.append(len(samples))
        return {"train/steps": float(bool(samples)), "train/empty_batch": float(not samples)}

    def save_version(self, version, out):
        return {}


def test_samples_too_few_for_every_rank_are_carried_into_the_next_minibatch(monkeypatch):
    from moerl.components.policy_update import streamed

    monkeypatch.setattr(streamed, "check_failures", lambda bus, cfg: None)
    cfg = load_config(EMBEDDED, ["rollout.samples_per_prompt=2"], mode="async")
    ranks = _Ranks(world=4)
    s = streamed.Streamed(cfg, None, ranks, 0, "engine")  # type: ignore[arg-type]
    group = [
        ScoredSample(
            prompt_id="p0",
            task="copy",
            prompt="x",
            answer="1",
            sample_index=j,
            prompt_token_ids=[1],
            response_token_ids=[2],
            response_logprobs=[-0.1],
            response_text="1",
            finish_reason="stop",
            policy_version=0,
            reward=float(j),
        )
        for j in range(2)
    ]
    s([group])  # 2 samples for 4 ranks: carried
    s([group])  # 4: one sample each
    s([group])  # 2 again: carried, and left over at the end
    assert ranks.sent == [0, 4, 0]
    m = s.save(Path("unused"))
    assert m["train/dropped_samples"] == 2.0 and m["train/steps"] == 1.0
