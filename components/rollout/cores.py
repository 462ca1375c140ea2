"""The vLLM engine behind `RolloutEngine`, for every layout, behind one small interface:

- `OfflineCore`: vLLM's `LLM` (data_parallel_size 1): the engine core in this process or its
  own, its workers in this process (one device) or one process per tensor-parallel rank;
  stepped by the caller.
- `AsyncCore`: vLLM's `AsyncLLM`, which a data-parallel engine needs (vLLM 0.32's `LLM` refuses
  DP > 1): its engine cores run on their own, keep MoE DP ranks in lock-step with dummy batches
  and take requests by load; driven from an event loop in a thread of this process, each request
  consumed to its final output and handed back through a queue.

The methods RolloutEngine calls are the same on both (`add`, `step`, `abort`, `collective_rpc`
to every rank of every engine core, `set_version`, `pause_keep` / `resume`,
`reset_prefix_cache`); which one a layout gets: `rollout.engine_api`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from typing import Any


def tokens_prompt(prompt: dict[str, Any]):
    """vLLM's TokensPrompt of {"prompt_token_ids": [...], "cache_salt": ... (optional)}."""
    from vllm.inputs import TokensPrompt

    tp = TokensPrompt(prompt_token_ids=list(prompt["prompt_token_ids"]))
    if prompt.get("cache_salt") is not None:
        tp["cache_salt"] = prompt["cache_salt"]
    return tp


# a bound on every wait for the async engine's loop: a wedged engine fails loudly, naming the call
CALL_TIMEOUT_S = 600.0


class OfflineCore:
    """vLLM's offline `LLM`, stepped by the caller (`LLMEngine.step`)."""

    api = "offline"

    def __init__(self, kwargs: dict[str, Any], in_process: bool) -> None:
        from vllm import LLM

        self.in_process = in_process
        self.llm = LLM(**kwargs)

    @property
    def vllm_config(self):
        return self.llm.llm_engine.vllm_config

    def add(self, request_id: str, prompt: dict[str, Any], params) -> None:
        rendered = self.llm._preprocess_cmpl_one(tokens_prompt(prompt))  # as LLM.generate does
        self.llm.llm_engine.add_request(request_id, rendered, params)

    def step(self) -> list[Any]:
        return list(self.llm.llm_engine.step())

    def abort(self, ids: list[str]) -> None:
        self.llm.llm_engine.abort_request(ids)  # external ids: vLLM aborts every child sample

    def generate(self, prompts: list[dict[str, Any]], params) -> list[Any]:
        return self.llm.generate([tokens_prompt(p) for p in prompts], params, use_tqdm=False)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.llm.collective_rpc(method, args=args)

    def set_version(self, label: str) -> None:
        self.llm.llm_engine.set_weight_version(label)

    def reset_prefix_cache(self, running: bool = False) -> bool:
        return bool(self.llm.reset_prefix_cache(reset_running_requests=running))

    def unfinished_sequences(self) -> int:
        return len(self.llm.llm_engine.output_processor.request_states)

    def pause_keep(self) -> None:
        """Stop scheduling, keeping every request (in process, not stepping is the pause)."""
        if not self.in_process:
            self.llm.llm_engine.engine_core.call_utility("pause_scheduler", "keep", False)  # type: ignore[attr-defined]

    def resume(self) -> None:
        if not self.in_process:
            self.llm.llm_engine.engine_core.call_utility("resume_scheduler")  # type: ignore[attr-defined]

    def close(self) -> None:
        llm, self.llm = self.llm, None  # type: ignore[assignment]
        del llm


class AsyncCore:
    """vLLM's `AsyncLLM` in an event loop on a thread of its own (see the module docstring)."""

    api = "async"

    def __init__(self, kwargs: dict[str, Any], step_wait_s: float = 0.05) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # AsyncLLM's engine cores are processes
        self.step_wait_s = step_wait_s
        self._done: queue.Queue[Any] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="moerl-async-engine", daemon=True
        )
        self._thread.start()
        self._tasks: dict[str, Any] = {}

        async def make():
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

        try:
            self.llm = self._call(make(), "starting the AsyncLLM engine")
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro, what: str, timeout: float = CALL_TIMEOUT_S):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError as err:
            fut.cancel()
            raise TimeoutError(
                f"the async rollout engine: {what} took over {timeout:.0f} s"
            ) from err

    @property
    def vllm_config(self):
        return self.llm.vllm_config

    def add(self, request_id: str, prompt: dict[str, Any], params) -> None:
        async def consume():
            final = None
            try:
                async for out in self.llm.generate(tokens_prompt(prompt), params, request_id):
                    final = out
            except asyncio.CancelledError:
                return
            except BaseException as err:  # noqa: BLE001 - handed to the caller's next step
                self._done.put(err)
                return
            finally:
                self._tasks.pop(request_id, None)
            if final is not None:
                self._done.put(final)

        self._tasks[request_id] = asyncio.run_coroutine_threadsafe(consume(), self._loop)

    def step(self) -> list[Any]:
        """The outputs finished since the last call; with none yet and requests running, waits
        up to `step_wait_s` for one (the engine runs on its own meanwhile)."""
        out: list[Any] = []
        try:
            if self._done.empty() and self._tasks:
                out.append(self._done.get(timeout=self.step_wait_s))
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        for x in out:
            if isinstance(x, BaseException):
                raise RuntimeError(f"the async rollout engine failed a request: {x!r}") from x
        return out

    def abort(self, ids: list[str]) -> None:
        self._call(self.llm.abort(ids), f"aborting {len(ids)} requests")

    def generate(self, prompts: list[dict[str, Any]], params) -> list[Any]:
        """Every prompt to its final output, in prompt order (the offline engine's `generate`)."""
        import uuid

        tag = uuid.uuid4().hex[:8]
        ids = [f"gen-{tag}-{i}" for i in range(len(prompts))]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        for rid, p, sp in zip(ids, prompts, plist):
            self.add(rid, p, sp)
        got: dict[str, Any] = {}
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len(got) < len(ids):
            if time.monotonic() > deadline:
                self.abort([r for r in ids if r not in got])
                raise TimeoutError(
                    f"the async rollout engine: generate finished {len(got)} of {len(ids)} "
                    f"prompts in {CALL_TIMEOUT_S:.0f} s"
                )
            for o in self.step():
                got[o.request_id] = o
        return [got[r] for r in ids]

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """`method` on every worker of every engine core (a data-parallel client's own
        collective_rpc answers with the first engine's workers only)."""
        core = self.llm.engine_core

        async def every_engine():
            if hasattr(core, "call_utility_all_async"):
                per = await core.call_utility_all_async("collective_rpc", method, None, args, None)
                return [r for workers in per for r in workers]
            return await self.llm.collective_rpc(method, args=args)

        return self._call(every_engine(), f"collective_rpc {method}")

    def set_version(self, label: str) -> None:
        self._call(self.llm.update_weight_version(label), "setting the weight version")

    def reset_prefix_cache(self, running: bool = False) -> bool:
        return bool(self._call(self.llm.reset_prefix_cache(running), "resetting the prefix cache"))

    def unfinished_sequences(self) -> int:
        return len(self.llm.output_processor.request_states)

    def pause_keep(self) -> None:
        self._call(self.llm.pause_generation(mode="keep", clear_cache=False), "pausing generation")

    def resume(self) -> None:
        self._call(self.llm.resume_generation(), "resuming generation")

    def _cancel_tasks(self) -> None:
        """Cancel every task on the loop (requests being consumed, vLLM's output handler)."""

        async def cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self._call(cancel_rest(), "cancelling its tasks", timeout=30)

    def _stop_loop(self) -> None:
        try:
            self._cancel_tasks()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        try:
            if llm is not None:
                # the output handler first: it would report the engine cores' exit as a death
                self._cancel_tasks()
                llm.shutdown()
                self.llm = None
        finally:
            self._stop_loop()
