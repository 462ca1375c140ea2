"""Records that flow between stages: each has a name and a schema.

Stages exchange JSONL files of these records (one record per line). `write_records` and
`read_records` validate at the boundary, so a malformed file fails with the file and line
number instead of a KeyError three stages later.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from moerl.errors import DataError


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_META_BYTES = 16 << 10  # a row's `meta` as JSON: test cases, puzzle state; not a payload store


class Message(_Record):
    """One chat message of a prompt given as `messages`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Prompt(_Record):
    """One dataset row: a prompt with its reference answer, and optional `meta` (any JSON
    object of at most 16 KiB: test cases, a generator's seed, puzzle state) that reaches the
    verifier with every sample of the row. The prompt is text (`prompt`) or chat `messages`
    (rendered with the tokenizer's chat template, `moerl/tasks/prompting.py`); one of them."""

    id: str = Field(min_length=1)
    task: str = Field(min_length=1)
    prompt: str = ""
    messages: list[Message] | None = None
    answer: str
    meta: dict[str, Any] | None = None

    @field_validator("meta")
    @classmethod
    def _meta(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_meta(v)

    @model_validator(mode="after")
    def _one_prompt(self) -> Prompt:
        if bool(self.prompt) == bool(self.messages):
            raise ValueError(
                "a row gives its prompt as `prompt` (text) or as `messages` (chat), exactly one of them"
            )
        return self

    @property
    def prompt_text(self) -> str:
        """The prompt as text: `prompt`, or the messages' contents one per line (for records and
        reward models; the engine gets the chat template's tokens)."""
        return self.prompt or "\n".join(m.content for m in self.messages or [])


def _check_meta(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is None:
        return v
    try:
        size = len(json.dumps(v, allow_nan=False).encode())
    except (TypeError, ValueError) as err:
        raise ValueError(f"not JSON-safe ({err})") from None
    if size > MAX_META_BYTES:
        raise ValueError(f"{size} bytes as JSON; at most {MAX_META_BYTES}")
    return v


class PreferencePair(_Record):
    """One preference row (issue: RLHF): for `prompt`, the response `chosen` is preferred to
    `rejected`."""

    id: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    chosen: str
    rejected: str


ROUTE_DTYPES = {"uint8": 1, "uint16": 2}


class RoutedExperts(_Record):
    """The experts a rollout engine routed every token of one sample to: ids [tokens, MoE
    layers, top-k] (tokens = prompt + response; the last response token is never fed to the
    engine, so its row is empty), little-endian `uint8` (at most 255 experts) or `uint16`,
    base64. An empty slot holds the dtype's largest value (`NO_ROUTE`): replay routes such a
    token live. About layers x top-k bytes a token: 752 for Qwen3-235B-A22B (94 x 8)."""

    dtype: Literal["uint8", "uint16"]
    shape: tuple[int, int, int]
    data: str

    @model_validator(mode="after")
    def _size(self) -> RoutedExperts:
        import base64
        import binascii

        if self.shape[0] < 0 or self.shape[1] < 1 or self.shape[2] < 1:
            raise ValueError(
                f"shape {list(self.shape)}: tokens must be >= 0, layers and top-k >= 1"
            )
        try:
            n = len(base64.b64decode(self.data, validate=True))
        except binascii.Error:
            raise ValueError("data is not base64") from None
        want = self.shape[0] * self.shape[1] * self.shape[2] * ROUTE_DTYPES[self.dtype]
        if n != want:
            raise ValueError(
                f"data holds {n} bytes; shape {list(self.shape)} of {self.dtype} needs {want}"
            )
        return self

    @property
    def no_route(self) -> int:
        return (1 << (8 * ROUTE_DTYPES[self.dtype])) - 1

    def ids(self):
        """int64 numpy array [tokens, layers, k], -1 where no route was recorded."""
        import base64

        import numpy as np

        a = np.frombuffer(
            base64.b64decode(self.data), dtype="<u1" if self.dtype == "uint8" else "<u2"
        )
        a = a.reshape(self.shape).astype(np.int64)
        a[a == self.no_route] = -1
        return a

    @classmethod
    def from_ids(cls, ids, num_experts: int | None = None) -> RoutedExperts:
        """From an integer array [tokens, layers, k] with -1 (or any negative) where none;
        `num_experts` None: sized by the largest id."""
        import base64

        import numpy as np

        a = np.asarray(ids, dtype=np.int64)
        if a.ndim != 3:
            raise ValueError(
                f"routed experts must be [tokens, layers, k], got shape {list(a.shape)}"
            )
        if num_experts is None:
            num_experts = int(a.max()) + 1 if a.size else 1
        dtype = "uint8" if num_experts < 255 else "uint16"
        if num_experts >= 65535:
            raise ValueError(f"{num_experts} experts do not fit uint16 route ids")
        if a.size and a.max() >= num_experts:
            raise ValueError(f"route id {int(a.max())} >= {num_experts} experts")
        none = (1 << (8 * ROUTE_DTYPES[dtype])) - 1
        packed = np.where(a < 0, none, a).astype("<u1" if dtype == "uint8" else "<u2")
        return cls(
            dtype=dtype, shape=tuple(a.shape), data=base64.b64encode(packed.tobytes()).decode()
        )


class Sample(_Record):
    """One generated response, as the engine produced it."""

    prompt_id: str
    task: str
    prompt: str
    answer: str
    sample_index: int
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    # The engine's logprob of each sampled response token (behavior policy).
    response_logprobs: list[float]
    response_text: str
    finish_reason: str
    policy_version: int
    meta: dict[str, Any] | None = None  # the dataset row's, for its verifier
    # Async mode: `<run_id>/<unit_id>/<k>:<prompt_id>/<sample_index>`, the same whichever worker
    # (re)generates it, so duplicates are dropped by id (moerl/bus/run.py).
    sample_id: str = ""
    # Multi-turn episodes (an environment, moerl/tasks/environments.py): the response tokens are
    # the model's turns and the environment's observations in order, exactly as the engine saw
    # them; `response_mask` is 1 for the model's tokens and 0 for the environment's (None: all
    # the model's). An environment token's logprob is 0.0 and never used.
    response_mask: list[int] | None = None
    turns: int = Field(1, ge=1)  # model turns
    final_response: str | None = None  # the model's last message (None: response_text)
    env_reward: float | None = None  # the sum of the rewards the environment's steps returned
    env_error: str | None = (
        None  # an environment call that failed: the episode is failed, never scored
    )
    # The engine's routes (rollout.return_routed_experts): [prompt + response tokens, layers, k]
    routed_experts: RoutedExperts | None = None
    # rollout.weight_update in_flight: the policy versions that sampled the response's tokens, as
    # runs [[first token index, version], ...] (the first at 0; indices and versions increasing);
    # None: every token from `policy_version`, which is always the first (oldest) run's version.
    token_versions: list[tuple[int, int]] | None = None
    # Async mode: the manifest sha256 of each policy version that sampled its tokens, as the
    # engine served it. A version number alone is ambiguous: after a rollback the trainer
    # publishes that number again with other weights, and the trainer drops a sample whose
    # (version, sha) is not one it published (components/buffer/worker.py `classify`).
    policy_shas: dict[int, str] | None = None

    @model_validator(mode="after")
    def _lengths(self) -> Sample:
        n = len(self.response_token_ids)
        if len(self.response_logprobs) != n:
            raise ValueError(
                f"{len(self.response_logprobs)} response_logprobs for {n} response tokens"
            )
        if self.response_mask is not None and (
            len(self.response_mask) != n or set(self.response_mask) - {0, 1}
        ):
            raise ValueError(f"response_mask must hold one 0 or 1 per response token ({n})")
        _check_routes(self)
        _check_versions(self)
        return self

    @property
    def answer_text(self) -> str:
        """What a verifier scores: the model's last message."""
        return self.response_text if self.final_response is None else self.final_response


class ScoredSample(Sample):
    """A sample with its verifier's reward. `reward_failed` samples score 0 and are counted."""

    reward: float
    reward_failed: bool = False
    reward_error: str | None = None
    model_score: float | None = None  # the reward model's raw score (reward.kind model or mixed)
    rule_score: float | None = None  # the verifier's (reward.kind rules or mixed)


class TrainSample(_Record):
    """What the trainer needs of one sample: tokens, behavior logprobs and its advantage."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    advantage: float
    policy_version: int
    response_mask: list[int] | None = (
        None  # 0: an environment's token, never in the loss (None: all 1)
    )
    routed_experts: RoutedExperts | None = (
        None  # the engine's routes (trainer.moe.router_replay R3)
    )
    token_versions: list[tuple[int, int]] | None = None  # as Sample's (in-flight weight updates)

    @model_validator(mode="after")
    def _routes(self) -> TrainSample:
        _check_routes(self)
        _check_versions(self)
        return self


def _check_versions(s) -> None:
    runs = s.token_versions
    if runs is None:
        return
    n = len(s.response_token_ids)
    if not runs or runs[0] != (0, s.policy_version):
        raise ValueError(
            f"token_versions must start with [0, policy_version] ([0, {s.policy_version}]), got "
            f"{runs[:1]}"
        )
    for (a, va), (b, vb) in zip(runs, runs[1:]):
        if not (a < b < n and va < vb):
            raise ValueError(
                f"token_versions runs must start at increasing token indices below {n} with increasing "
                f"versions; got [{a}, {va}] then [{b}, {vb}]"
            )


def newest_version(s) -> int:
    """The newest policy version that sampled a token of `s` (its `policy_version` unless an
    in-flight weight update fell inside the response)."""
    return s.token_versions[-1][1] if s.token_versions else s.policy_version


def token_versions(s) -> list[int]:
    """The policy version of each response token of sample `s` (Sample or TrainSample)."""
    runs = s.token_versions or [(0, s.policy_version)]
    n = len(s.response_token_ids)
    out: list[int] = []
    for i, (start, v) in enumerate(runs):
        end = runs[i + 1][0] if i + 1 < len(runs) else n
        out.extend([v] * (end - start))
    return out


def _check_routes(s) -> None:
    r = s.routed_experts
    if r is not None and r.shape[0] != len(s.prompt_token_ids) + len(s.response_token_ids):
        raise ValueError(
            f"routed_experts covers {r.shape[0]} tokens; the sample has "
            f"{len(s.prompt_token_ids) + len(s.response_token_ids)} (prompt + response)"
        )


class PolicyVersion(_Record):
    """A published policy version: where it lives and how to check it."""

    version: int = Field(ge=0)
    uri: str
    manifest_sha256: str


R = TypeVar("R", bound=BaseModel)


def write_records(path: str | Path, records: Iterable[BaseModel]) -> int:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with p.open("w") as f:
        for r in records:
            f.write(r.model_dump_json())
            f.write("\n")
            n += 1
    return n


def read_records(path: str | Path, cls: type[R]) -> list[R]:
    """Read a JSONL file of `cls` records; any bad line is a `DataError` naming file and line."""
    out: list[R] = []
    p = Path(path)
    with p.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(cls.model_validate(json.loads(line)))
            except (json.JSONDecodeError, ValidationError) as err:
                raise DataError(f"{p}:{lineno}: not a valid {cls.__name__} record: {err}") from None
    return out
