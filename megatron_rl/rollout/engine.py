"""The engine handle of the rollout side: sampling parameters in, samples out.

`SamplingParams` and `Sample` are plain data (`types.py`). `RolloutEngine` runs an `SGLangClient` on the
rollout runtime's event loop (`event_loop.RolloutLoop`): `generate` is a coroutine on that loop (the
`types.Engine` the episodes, the gateway and the collection await); the weight sync's calls come from
the trainer's main thread through `run` (bounded) and `submit`. It talks to real SGLang servers or the
local engine, which it starts itself when no SGLang address is configured, with `configured_api_key` or
else a random key of its own (`client.api_key`). A configured address that is an sglang-router is found
at start-up (`SGLangClient.use_router`): generation goes through it, control calls and weight updates to
the workers it lists. Servers older than what the run's options need (`sglang_versions`: per-token
versions for partial rollouts, LoRA adapters from tensors or on the experts) are refused here, naming
their version.

Supervision of the local engine child, on the loop: a request that cannot connect while the child has
exited fails at once with `EngineDiedError` (its exit code) instead of being retried; `generate` then
restarts the child on the same port from the model folder (on a worker thread: the start blocks), hands
`resync` (the trainer's weight sync pushes the current weights: a collective of every trainer rank) to
the main thread (`handoff`) and awaits it, sends the unfinished requests again and goes on; the finished
ones are kept. One restart runs at a time (an `asyncio.Lock`), and every coroutine that saw the same
death sends its requests again once it is done. No request reaches a restarted engine before its resync:
the client's `weights_current` (an asyncio event) is cleared, in the same loop turn that sees the death,
before the new child starts, and set when the resync has ended; every /generate attempt, retries
included, waits for it (at most `rollout.request_timeout_s`). After `rollout.max_engine_restarts`
restarts the next death stops the run, with the exit code and the tail of the engine's log. A task on
the loop ("engine-stall-watch") warns every `rollout.stall_warning_s` without a reply while requests are
in flight, naming them (and whether the child is stopped, e.g. by SIGSTOP).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import subprocess
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from megatron_rl.rollout.event_loop import CLOSE_TIMEOUT_S, RolloutLoop
from megatron_rl.rollout.handoff import MainThreadCalls
from megatron_rl.rollout.local.launcher import (
    API_KEY_ENV,
    LocalEngineProcess,
    StartingEngine,
    spawn_local_engine,
)
from megatron_rl.rollout.sglang import EngineDiedError, SGLangClient
from megatron_rl.rollout.sglang_versions import require_versions, version_needs
from megatron_rl.rollout.types import PromptScores, Sample, SamplingParams

T = TypeVar("T")

log = logging.getLogger(__name__)
# a resync handed to the main thread (which may be in a long training step) is waited for this long at
# a time, warning after each wait, until it ran or the hand-off is closed (the run ends)
HANDOFF_WARN_S = 60.0


def configured_api_key(rollout: Any) -> str | None:
    """The engines' key: `rollout.api_key`, else $MEGATRON_RL_ENGINE_API_KEY (the Slurm scripts' job key)."""
    return rollout.api_key or os.environ.get(API_KEY_ENV) or None


def spawn_local(
    rollout: Any, model_path: str | None, *, port: int | None = None, api_key: str | None = None, **local_kwargs: Any
) -> StartingEngine:
    """The local engine's child spawned with the run's keys, not waited for (`from_config(starting=...)`
    waits): it loads its model while the trainer starts the actor. `port` and `api_key` (a restart's: the
    dead engine's) default to `rollout.port` and the run's key."""
    if model_path is None:
        raise ValueError("rollout.engine = local needs a model folder (model.hf_path) to serve")
    # the engine this run starts requires a key: without one, any local process could post it weights
    api_key = api_key or configured_api_key(rollout) or secrets.token_urlsafe(32)
    return spawn_local_engine(
        model_path,
        host=rollout.host,
        port=rollout.port if port is None else port,
        api_key=api_key,
        admin_api_key=rollout.admin_api_key,
        **local_kwargs,
    )


def moe_layout(model_path: str) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) of a Hugging Face MoE folder; None for a dense model.
    Read, as SGLang reads them, from the text sub-config of a model that nests one (`text_config`)."""
    import json
    from pathlib import Path

    config = json.loads((Path(model_path) / "config.json").read_text())
    config = config.get("text_config") or config
    if not (config.get("num_experts") or config.get("num_local_experts")):
        return None
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


class RolloutEngine:
    """The engine client on the rollout loop (see the module doc); a `types.Engine`."""

    def __init__(
        self,
        client: SGLangClient,
        loop: RolloutLoop,
        local_process: LocalEngineProcess | None = None,
        *,
        restart: Callable[[LocalEngineProcess], LocalEngineProcess] | None = None,
        max_restarts: int = 0,
        stall_warning_s: float = 0.0,
    ) -> None:
        self.loop = loop
        self.client = client
        self.local_process = local_process
        self._restart = restart  # starts a new child in place of the dead one (the same port)
        self.max_restarts, self.restarts = max_restarts, 0
        self.stall_warning_s = stall_warning_s
        # pushes the current weights to a restarted engine (the trainer's weight sync); None: the
        # model folder the child starts from is current
        self.resync: Callable[[], None] | None = None
        # where a resync runs (the runtime's main thread); None: on a worker thread
        self.handoff: MainThreadCalls | None = None
        self._restart_lock = asyncio.Lock()
        client.weights_current = asyncio.Event()  # cleared from a restart until its resync is done
        client.weights_current.set()
        if local_process is not None:
            client.dead_reason = self._dead_reason
        self.run(client.start())
        if local_process is not None and client.routed_experts_layout is None:
            self.run(client.load_model_layout())
        self._stall_watch = self.run(self._start_stall_watch()) if stall_warning_s else None

    async def _start_stall_watch(self) -> asyncio.Task:
        return asyncio.get_running_loop().create_task(self._watch_stalls(), name="engine-stall-watch")

    @classmethod
    def from_config(
        cls,
        rollout: Any,
        loop: RolloutLoop,
        model_path: str | None = None,
        starting: StartingEngine | None = None,
        *,
        model: Any = None,
        **local_kwargs: Any,
    ) -> RolloutEngine:
        """On `loop`: connect to `rollout.sglang_urls`, or start the local engine on `model_path` when there are none;
        `starting`: the local engine `spawn_local(rollout, model_path, ...)` spawned earlier (waited for here);
        `model`: the run's model section, whose LoRA adapters may need a newer SGLang (`sglang_versions`)."""
        process = None
        restart: Callable[[LocalEngineProcess], LocalEngineProcess] | None = None
        urls = list(rollout.sglang_urls)
        api_key = configured_api_key(rollout)
        if rollout.uses_local_engine:
            starting = starting or spawn_local(rollout, model_path, **local_kwargs)
            api_key = starting.api_key
            process = starting.wait()
            urls = [process.url]

            def start_again(dead: LocalEngineProcess) -> LocalEngineProcess:
                return spawn_local(rollout, model_path, port=dead.port, api_key=api_key, **local_kwargs).wait()

            restart = start_again

        client = SGLangClient(
            urls,
            api_key=api_key,
            max_concurrency=rollout.max_concurrency,
            timeout_s=rollout.request_timeout_s,
            max_retries=rollout.max_retries,
            routed_experts_layout=moe_layout(model_path) if model_path else None,
            admin_api_key=rollout.admin_api_key,
        )
        engine = cls(
            client,
            loop,
            process,
            restart=restart,
            max_restarts=rollout.max_engine_restarts,
            stall_warning_s=rollout.stall_warning_s,
        )
        try:
            if process is None:
                engine.run(client.use_router())  # an sglang-router: generate through it, sync its workers
            engine.run(require_versions(client, version_needs(rollout, model)))
        except BaseException:
            engine.close()
            raise
        return engine

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """(Not on the loop.) A client coroutine's result, run on the loop; TimeoutError after `timeout`
        seconds (by default the client's bound on one request with its retries)."""
        return self.loop.run(coro, self.request_bound_s if timeout is None else timeout)

    @property
    def request_bound_s(self) -> float:
        """The longest one client call may take: each try's timeout, the backoffs, a resync's wait."""
        client = self.client
        return (client.max_retries + 2) * client.timeout_s + client.backoff_s * 2**client.max_retries

    async def _watch_stalls(self) -> None:
        replies = self.client.replies
        while True:
            await asyncio.sleep(self.stall_warning_s)
            if self.client.replies == replies and any(self.client.in_flight().values()):
                self._warn_stalled(self.stall_warning_s)
            replies = self.client.replies

    def _warn_stalled(self, quiet_s: float) -> None:
        in_flight = self.client.in_flight()
        state = ""
        if self.local_process is not None and self.local_process.stopped():
            state = f"; the local engine process {self.local_process.process.pid} is stopped (SIGSTOP?)"
        if self.client.waiting_for_weights:
            state += f"; {self.client.waiting_for_weights} wait for the restarted engine's resync"
        log.warning(
            "no reply from the rollout engine for %.0f s (rollout.stall_warning_s): %d request(s) in flight (%s)%s",
            quiet_s,
            sum(in_flight.values()),
            ", ".join(f"{url}: {n}" for url, n in in_flight.items()) or "none",
            state,
        )

    def _dead_reason(self, url: str) -> str | None:
        """On the client's loop, after a connection error to `url`: why the local child is gone, if it is."""
        process = self.local_process
        if process is None or url != process.url:
            return None
        try:  # a child killed a moment ago may not be reaped yet
            code = process.process.wait(1.0)
        except subprocess.TimeoutExpired:
            return None
        return f"the local engine (pid {process.process.pid}) exited with code {code}"

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """(Not on the loop.) Start a client coroutine on the loop; its `concurrent.futures.Future`."""
        return self.loop.submit(coro)

    async def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        return_routed_experts: bool = False,
    ) -> list[Sample]:
        """Generate one response per prompt (repeat a prompt for a group), in prompt order; `params`
        is shared or one per prompt (e.g. a `sampling_seed` each). A local engine that dies meanwhile
        is restarted (see the module docstring) and only the unfinished requests are sent again."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        done: dict[int, Sample] = {}
        while True:
            serving = self.local_process
            todo = [i for i in range(len(prompts)) if i not in done]
            finished: dict[int, Sample] = {}
            try:
                await self.client.generate_batch(
                    [prompts[i] for i in todo],
                    [per_prompt[i] for i in todo],
                    return_routed_experts=return_routed_experts,
                    done=finished,
                )
                done.update({todo[j]: sample for j, sample in finished.items()})
                return [done[i] for i in range(len(prompts))]
            except EngineDiedError as err:
                done.update({todo[j]: sample for j, sample in finished.items()})
                await self._restart_dead_engine(err, serving, len(prompts) - len(done))

    async def prompt_logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """Each sequence's log-probs of its tokens from its start on: `prompt_scores` without the top-k."""
        return [scores.logprobs for scores in await self.prompt_scores(sequences, starts)]

    async def prompt_scores(
        self, sequences: Sequence[Sequence[int]], starts: Sequence[int], top_k: int = 0
    ) -> list[PromptScores]:
        """Each sequence's log-probs of its tokens from its start on, and with `top_k` the k most likely tokens
        at each (`GenerationClient.prompt_scores`), the requests concurrent within the client's bound: the
        teacher's scoring in on-policy distillation. A local engine that dies meanwhile is restarted as for
        `generate`, and only the unscored sequences sent again."""
        done: dict[int, PromptScores] = {}

        async def one(i: int) -> None:
            done[i] = await self.client.prompt_scores(sequences[i], starts[i], top_k)

        while True:
            serving = self.local_process
            tasks = [asyncio.ensure_future(one(i)) for i in range(len(sequences)) if i not in done]
            try:
                await asyncio.gather(*tasks)
                return [done[i] for i in range(len(sequences))]
            except BaseException as err:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if not isinstance(err, EngineDiedError):
                    raise
                await self._restart_dead_engine(err, serving, len(sequences) - len(done))

    async def _restart_dead_engine(
        self, err: EngineDiedError, dead: LocalEngineProcess | None, unfinished: int
    ) -> None:
        """Start the local engine again in place of `dead` and give it the current weights, unless
        another coroutine's report of the same death did already; raises `EngineDiedError` with the
        log's tail once `max_restarts` are used up."""
        gate = self.client.weights_current
        assert gate is not None
        if dead is None or dead is self.local_process:
            gate.clear()  # at once, before any other coroutine can send to the new child
        async with self._restart_lock:
            if dead is not None and dead is not self.local_process:
                return  # restarted meanwhile: send again
            try:
                await self._restart_locked(err, unfinished)
            finally:
                gate.set()

    async def _restart_locked(self, err: EngineDiedError, unfinished: int) -> None:
        dead = self.local_process
        if dead is None or self._restart is None:
            raise err
        if self.restarts >= self.max_restarts:
            raise EngineDiedError(
                f"{err}; restarted {self.restarts} time(s) already (rollout.max_engine_restarts = "
                f"{self.max_restarts}): stopping. Last lines of {dead.log_path}:\n{dead.log_tail()}",
                server=err.server,
            ) from None
        self.restarts += 1
        log.warning(
            "%s: restarting it (%d of rollout.max_engine_restarts = %d); %d unfinished request(s) will be sent again",
            err,
            self.restarts,
            self.max_restarts,
            unfinished,
        )
        self.local_process = await asyncio.to_thread(self._restart, dead)
        if self.resync is None:
            return
        if self.handoff is None:
            await asyncio.to_thread(self.resync)
            return
        handed = self.handoff.submit(self.resync, "resyncing the restarted rollout engine")
        began = time.monotonic()
        while True:  # the main thread runs it at its next wait for the rollout side
            try:
                return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(handed)), HANDOFF_WARN_S)
            except TimeoutError:
                waited = time.monotonic() - began
                log.warning("resyncing the restarted rollout engine: waiting %.0f s for the main thread", waited)

    def close(self) -> None:
        """(Not on the loop.) Disconnect, then stop the local engine's child."""
        try:
            if self._stall_watch is not None:
                self.loop.loop.call_soon_threadsafe(self._stall_watch.cancel)
            self.run(self.client.close(), timeout=CLOSE_TIMEOUT_S)
        finally:
            if self.local_process is not None:
                self.local_process.stop()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
