"""Multi-turn episodes, token in and token out: the model's turns and an environment's
observations (`moerl/tasks/environments.py`) joined into one sample the trainer learns from.

Design, details and limitations: docs/async.md#componentsrolloutepisodespy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from moerl.config import RunConfig
from moerl.errors import ConfigError
from moerl.records import Prompt, Sample
from moerl.tasks.environments import CLOSE, LOST, RESET, STEP, environment_for
from moerl.tasks.sandbox import Limits, SandboxPool

_MARK = "\u2063moerl-assistant\u2063"


@dataclass
class Episode:
    key: str  # unique among the pool's live episodes
    row: dict[str, Any]  # the dataset row (Prompt.model_dump())
    prompt_ids: list[int]
    sample_index: int
    env: str | None  # the environment's import path; None: one turn
    templated: bool = False  # the prompt went through the chat template
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the model's messages
    pieces: list[str] = field(default_factory=list)  # the transcript after the prompt, in order
    rewards: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    finish_reason: str = ""
    error: str | None = None
    reset: bool = False  # the environment holds state for this episode
    # reset's observation, then each step's
    observed: list[str | None] = field(default_factory=list)
    ended_s: float | None = None  # when it ended, seconds after `run_episodes` began (the tail)
    # the engine's routes of the last turn's request (rollout.return_routed_experts): its prompt
    # is the whole episode so far, so they cover every token before that turn's last one
    routes: Any = None

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def sample(self, version: int, sample_id: str = "") -> Sample:
        r = self.row
        multi = self.env is not None
        return Sample(
            prompt_id=r["id"],
            task=r["task"],
            prompt=Prompt.model_validate(r).prompt_text,
            answer=r["answer"],
            sample_index=self.sample_index,
            prompt_token_ids=self.prompt_ids,
            response_token_ids=self.tokens,
            response_logprobs=self.logprobs,
            response_text="".join(self.pieces),
            finish_reason=self.finish_reason or "stop",
            policy_version=version,
            meta=r.get("meta"),
            sample_id=sample_id,
            response_mask=self.mask if multi else None,
            turns=max(self.turns, 1),
            final_response=(self.texts[-1] if self.texts else "") if multi else None,
            env_reward=sum(self.rewards) if self.rewards else None,
            env_error=self.error,
            routed_experts=self._routed(),
        )

    def _routed(self):
        if self.routes is None:
            return None
        from moerl.components.rollout.routes import complete_rows
        from moerl.records import RoutedExperts

        # an observation appended after the last turn has no route yet: -1, routed live (masked out of the loss)
        return RoutedExperts.from_ids(
            complete_rows(self.routes, len(self.prompt_ids) + len(self.tokens))
        )


def env_pool(cfg: RunConfig) -> SandboxPool:
    sb = cfg.task.sandbox
    return SandboxPool(
        Limits(
            timeout_s=sb.sample_timeout_s,
            memory_mb=sb.memory_mb,
            workers=sb.workers,
            isolation=sb.isolation,
        )
    )


def uses_environments(cfg: RunConfig) -> bool:
    return bool(cfg.task.environment or cfg.task.environments)


class EpisodeDriver:
    """Resets, steps and closes episodes' environments in `pool`; appends turns and
    observations as tokens. Counts what it did (`metrics`)."""

    def __init__(self, cfg: RunConfig, tokenizer, pool: SandboxPool):
        self.cfg, self.tok, self.pool = cfg, tokenizer, pool
        self.env_s = 0.0  # wall time in environment calls (reset, step, close)
        self.calls = 0
        self.timeouts = self.errors = 0
        self.replays = 0  # episodes rebuilt on another child (`_replay`)
        self._chat: tuple[str, str] | None = None

    def episode(
        self, key: str, row: dict[str, Any], prompt_ids: list[int], j: int, templated: bool
    ) -> Episode:
        env = environment_for(row["task"], self.cfg.task.environment, self.cfg.task.environments)
        return Episode(
            key=key,
            row=row,
            prompt_ids=list(prompt_ids),
            sample_index=j,
            env=env,
            templated=templated,
        )

    # -- environment calls ----------------------------------------------------------------
    def _call(self, eps: list[Episode], target: str, args: list[list]) -> list:
        t0 = time.perf_counter()
        outs = self.pool.run([(target, a) for a in args], keys=[e.key for e in eps])
        self.env_s += time.perf_counter() - t0
        self.calls += len(eps)
        return outs

    def _fail(self, ep: Episode, error: str, kind: str) -> None:
        ep.error, ep.done, ep.finish_reason = error, True, "env_error"
        if kind == "timeout":
            self.timeouts += 1
        else:
            self.errors += 1

    def begin(self, eps: list[Episode]) -> None:
        """Reset the environment of each multi-turn episode on its row; a first observation
        is appended as environment tokens."""
        multi = [e for e in eps if e.env is not None]
        for e, o in zip(multi, self._call(multi, RESET, [[e.env, e.key, e.row] for e in multi])):
            e.reset = True
            if not o.ok:
                self._fail(e, f"{e.env}.reset: {o.error}", o.kind)
                continue
            e.observed.append(o.value)
            if o.value:
                self._observe(e, o.value)
        for e in eps:
            if not e.done and self.budget(e) < 1:
                e.done, e.finish_reason = True, "length"

    def budget(self, ep: Episode) -> int:
        """The most tokens the episode's next turn may generate (0: none left): the longest
        length of `rollout.max_new_tokens_schedule` (the engine cuts it to its own version's,
        `RolloutEngine.sampling_params`), within what max_total_tokens leaves."""
        from moerl.tasks.prompting import max_new_tokens_ceiling

        r, most = self.cfg.rollout, max_new_tokens_ceiling(self.cfg.rollout)
        if r.max_total_tokens is None:
            return most
        return max(0, min(most, r.max_total_tokens - len(ep.context)))

    def advance(self, turns: list[tuple[Episode, Any]]) -> list[Episode]:
        """Append each episode's model turn (a `Completion`), step its environment, append the
        observation; the episodes that go on to another turn."""
        stepping = []
        for ep, c in turns:
            ep.tokens += c.token_ids
            ep.logprobs += c.logprobs
            ep.routes = c.routes
            ep.mask += [1] * len(c.token_ids)
            ep.texts.append(c.text)
            ep.pieces.append(c.text)
            ep.turns += 1
            ep.finish_reason = c.finish_reason
            if ep.env is None:
                ep.done = True
            else:
                stepping.append(ep)
        outs = self._call(stepping, STEP, [[e.key, e.texts[-1]] for e in stepping])
        lost = [i for i, o in enumerate(outs) if o.kind == "error" and LOST in o.error]
        for i, o in zip(lost, self._replay([stepping[i] for i in lost])):
            outs[i] = o
        for ep, o in zip(stepping, outs):
            if not o.ok:
                self._fail(ep, f"{ep.env}.step: {o.error}", o.kind)
                continue
            obs, reward, done = o.value
            ep.observed.append(obs)
            if reward is not None:
                ep.rewards.append(reward)
            if done:
                ep.done = True
                continue
            if ep.turns >= self.cfg.task.max_turns:
                ep.done, ep.finish_reason = True, "max_turns"
                continue
            if obs:
                self._observe(ep, obs)
            if self.budget(ep) < 1:
                ep.done, ep.finish_reason = True, "length"
        return [ep for ep, _ in turns if not ep.done]

    def _replay(self, eps: list[Episode]) -> list:
        """Rebuild episodes whose state went with a child that was replaced (another episode's
        call hung or crashed it): reset and step each again with the model's messages so far,
        then run its current step. An environment is expected to be deterministic in its row
        and the messages; one whose replayed observations differ from the first time's is
        failed ("not deterministic"), never continued on a different state."""
        from moerl.tasks.sandbox import Outcome

        calls: list[tuple[str, list]] = []
        keys: list[str | None] = []
        for e in eps:
            calls += [(RESET, [e.env, e.key, e.row])] + [(STEP, [e.key, t]) for t in e.texts]
            keys += [e.key] * (len(e.texts) + 1)
        t0 = time.perf_counter()
        outs = self.pool.run(calls, keys=keys)
        self.env_s += time.perf_counter() - t0
        self.calls += len(calls)
        self.replays += len(eps)
        got, pos = [], 0
        for e in eps:
            mine, pos = outs[pos : pos + len(e.texts) + 1], pos + len(e.texts) + 1
            bad = next((o for o in mine[:-1] if not o.ok), None)
            seen = [mine[0].value] + [o.value[0] for o in mine[1:-1]] if bad is None else []
            if bad is not None:
                got.append(
                    Outcome(
                        bad.kind,
                        error=f"replaying the episode after its process was replaced: {bad.error}",
                    )
                )
            elif seen != e.observed:
                got.append(
                    Outcome(
                        "error",
                        error="not deterministic: replaying the episode after its process was "
                        "replaced gave other observations than the first time",
                    )
                )
            else:
                got.append(mine[-1])
        return got

    def finish(self, eps: list[Episode]) -> None:
        """Close the environments the episodes hold (in the child that holds each)."""
        held = [e for e in eps if e.reset]
        self._call(held, CLOSE, [[[e.key]] for e in held])
        self.pool.release([e.key for e in held])
        for e in held:
            e.reset = False

    def metrics(self, eps: list[Episode], total_s: float) -> dict[str, float]:
        multi = [e for e in eps if e.env is not None]
        n = max(len(multi), 1)
        return {
            "env/episodes": float(len(multi)),
            "env/turns_mean": sum(e.turns for e in multi) / n,
            "env/max_turns_fraction": sum(e.finish_reason == "max_turns" for e in multi) / n,
            "env/error_episodes": float(self.errors),
            "env/timeout_episodes": float(self.timeouts),
            # a call whose process sent another call's reply or a second line (killed, failed)
            "env/forged_episodes": float(sum("forged:" in (e.error or "") for e in multi)),
            "env/calls": float(self.calls),
            "env/replayed_episodes": float(self.replays),
            "env/time_s": self.env_s,
            "env/share": self.env_s
            / max(total_s, 1e-9),  # of the rollout's time, the engine idle in it
            "env/reward_mean": sum(sum(e.rewards) for e in multi) / n,
        }

    # -- observations as tokens -------------------------------------------------------------
    def _observe(self, ep: Episode, obs: str) -> None:
        ids, text = self.observation(ep, obs)
        r = self.cfg.rollout
        if r.max_total_tokens is not None:
            ids = ids[: max(0, r.max_total_tokens - len(ep.context))]
        ep.tokens += ids
        ep.logprobs += [0.0] * len(ids)
        ep.mask += [0] * len(ids)
        ep.pieces.append(text)

    def observation(self, ep: Episode, obs: str) -> tuple[list[int], str]:
        """The token ids (and text) that put `obs` after the episode's last model turn."""
        if not ep.templated:
            return list(self.tok.encode(obs, add_special_tokens=False)), obs
        close, head = self._chat_parts()
        if ep.tokens and close:  # the model may have closed its turn itself (its end-of-turn token)
            last = self.tok.decode(ep.tokens[-1:], skip_special_tokens=False)
            if last and close.startswith(last):
                close = close[len(last) :]
        text = close + head.replace(_MARK, obs)
        return list(self.tok.encode(text, add_special_tokens=False)), text

    def _chat_parts(self) -> tuple[str, str]:
        """(what closes an assistant turn, a tool message and the next assistant prompt with
        `_MARK` for its content), from the chat template."""
        if self._chat is None:
            base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK + "a"}]
            t_base = self.tok.apply_chat_template(base, tokenize=False)
            t_full = self.tok.apply_chat_template(
                base + [{"role": "tool", "content": _MARK}],
                tokenize=False,
                add_generation_prompt=True,
            )
            if not t_full.startswith(t_base) or (_MARK + "a") not in t_base:
                raise ConfigError(
                    "the tokenizer's chat template does not render a conversation as a prefix of its "
                    "continuation, so an environment's observation cannot be appended token by token; "
                    "allowed: rollout.chat_template false with text prompts, or another template"
                )
            close = t_base[t_base.rindex(_MARK + "a") + len(_MARK) + 1 :]
            self._chat = (close, t_full[len(t_base) :])
        return self._chat


def run_episodes(engine, driver: EpisodeDriver, eps: list[Episode]) -> float:
    """Drive `eps` to their end with the engine's batch `generate`, one turn at a time over
    every live episode (the sync stage). Returns the seconds spent generating."""
    gen_s, start = 0.0, time.perf_counter()

    def ended(batch) -> None:
        for e in batch:
            if e.done and e.ended_s is None:
                e.ended_s = time.perf_counter() - start

    driver.begin(eps)
    ended(eps)
    live = [e for e in eps if not e.done]
    try:
        while live:
            t0 = time.perf_counter()
            comps = engine.generate(
                [e.context for e in live], 1, max_tokens=[driver.budget(e) for e in live]
            )
            gen_s += time.perf_counter() - t0
            batch, live = live, driver.advance([(e, c[0]) for e, c in zip(live, comps)])
            ended(batch)
    finally:
        driver.finish(eps)
    return gen_s
