"""What the trainer sees of a rollout engine: sampling parameters in, samples out.

`SamplingParams` and `Sample` are plain data (`types.py`). `RolloutEngine` is the synchronous handle
the trainer holds: it runs an `SGLangClient` on a private event-loop thread (so the trainer needs no
asyncio) against real SGLang servers or the local engine, which it starts itself when no SGLang
address is configured, with `configured_api_key` or else a random key of its own (`client.api_key`). A configured address that is an sglang-router is found at start-up
(`SGLangClient.use_router`): generation goes through it, control calls and weight updates to the
workers it lists. Servers older than what the run's options need (`sglang_versions`: per-token versions
for partial rollouts, LoRA adapters from tensors or on the experts) are refused here, naming their version.
Any client coroutine can also be run with `run` or started with `submit`
(e.g. post `/update_weights_from_distributed`, then broadcast, then wait).

Supervision of the local engine child: a request that cannot connect while the child has exited
fails at once with `EngineDiedError` (its exit code) instead of being retried; `generate` then
restarts the child on the same port from the model folder, calls `resync` (the trainer's weight
sync pushes the current weights), sends the unfinished requests again and goes on; the finished
ones are kept. One restart runs at a time: the restart and its resync run on the trainer's main
thread (`handoff`, when the driver gives one: a worker thread that saw the death hands them over
and waits), and every thread that saw the same death sends its requests again once it is done.
No request reaches a restarted engine before its resync: the client's `weights_current` (an asyncio
event on its loop) is cleared before the new child starts and set when the resync has ended, and
every /generate attempt, retries included, waits for it (at most `rollout.request_timeout_s`). After `rollout.max_engine_restarts` restarts
the next death stops the run, with the exit code and the tail of the engine's log. Every `rollout.stall_warning_s` without a reply while
the trainer waits, a warning gives the requests in flight (and whether the child is stopped, e.g.
by SIGSTOP). Closing cancels what is still pending on the client's loop first (an interrupted
`generate`), so an interrupted run ends quietly.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from megatron_rl.rollout.handoff import MainThreadCalls
from megatron_rl.rollout.local.launcher import (
    API_KEY_ENV,
    LocalEngineProcess,
    StartingEngine,
    spawn_local_engine,
    start_local_engine,
)
from megatron_rl.rollout.sglang import EngineDiedError, SGLangClient
from megatron_rl.rollout.sglang_versions import require_versions, version_needs
from megatron_rl.rollout.types import Sample, SamplingParams

T = TypeVar("T")

log = logging.getLogger(__name__)
CLIENT_THREAD_JOIN_S = 10.0  # how long close() waits for the client thread to stop


def configured_api_key(rollout: Any) -> str | None:
    """The engines' key: `rollout.api_key`, else $MEGATRON_RL_ENGINE_API_KEY (the Slurm scripts' job key)."""
    return rollout.api_key or os.environ.get(API_KEY_ENV) or None


def spawn_local(rollout: Any, model_path: str | None, **local_kwargs: Any) -> StartingEngine:
    """The local engine's child spawned with the run's key, not waited for (`from_config(starting=...)`
    waits): it loads its model while the trainer starts the actor."""
    if model_path is None:
        raise ValueError("rollout.engine = local needs a model folder (model.hf_path) to serve")
    # the engine this run starts requires a key: without one, any local process could post it weights
    api_key = configured_api_key(rollout) or secrets.token_urlsafe(32)
    return spawn_local_engine(
        model_path,
        host=rollout.host,
        port=rollout.port,
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
    """Synchronous access to SGLang servers (or the local engine) for a trainer."""

    def __init__(
        self,
        client: SGLangClient,
        local_process: LocalEngineProcess | None = None,
        *,
        restart: Callable[[LocalEngineProcess], LocalEngineProcess] | None = None,
        max_restarts: int = 0,
        stall_warning_s: float = 0.0,
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True)
        self._thread.start()
        self.client = client
        self.local_process = local_process
        self._restart = restart  # starts a new child in place of the dead one (the same port)
        self.max_restarts, self.restarts = max_restarts, 0
        self.stall_warning_s = stall_warning_s
        self._stall_lock = threading.Lock()
        self._last_stall_warning = float("-inf")  # one warning per stall for all the threads that wait
        # pushes the current weights to a restarted engine (the trainer's weight sync); None: the
        # model folder the child starts from is current
        self.resync: Callable[[], None] | None = None
        # where restarts and resyncs run (the driver's); None: on the thread that saw the death
        self.handoff: MainThreadCalls | None = None
        self._restart_lock = threading.Lock()
        client.weights_current = asyncio.Event()  # cleared from a restart until its resync is done
        client.weights_current.set()
        if local_process is not None:
            client.dead_reason = self._dead_reason
        self.run(client.start())
        if local_process is not None and client.routed_experts_layout is None:
            self.run(client.load_model_layout())

    @classmethod
    def from_config(
        cls,
        rollout: Any,
        model_path: str | None = None,
        starting: StartingEngine | None = None,
        *,
        model: Any = None,
        **local_kwargs: Any,
    ) -> RolloutEngine:
        """Connect to `rollout.sglang_urls`, or start the local engine on `model_path` when there are none;
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
                return start_local_engine(
                    model_path,
                    host=rollout.host,
                    port=dead.port,
                    api_key=api_key,
                    admin_api_key=rollout.admin_api_key,
                    **local_kwargs,
                )

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
        """Run a client coroutine on the engine's loop and wait for its result (a warning every
        `stall_warning_s` without a reply from any server)."""
        future = self.submit(coro)
        if not self.stall_warning_s:
            return future.result(timeout)
        began = time.monotonic()
        quiet_since, replies = began, self.client.replies
        while True:
            wait = self.stall_warning_s - (time.monotonic() - quiet_since)
            if timeout is not None:
                wait = min(wait, timeout - (time.monotonic() - began))
            try:
                return future.result(max(wait, 0.0))
            except concurrent.futures.TimeoutError:
                if future.done():  # the coroutine's own timeout, not this wait's
                    raise
            now = time.monotonic()
            if timeout is not None and now - began >= timeout:
                raise concurrent.futures.TimeoutError(f"no result within {timeout:.0f} s")
            if self.client.replies != replies:
                quiet_since, replies = now, self.client.replies
            elif now - quiet_since >= self.stall_warning_s:
                self._warn_stalled(now - quiet_since)
                quiet_since = now  # the next warning after another stall_warning_s

    def _warn_stalled(self, quiet_s: float) -> None:
        with self._stall_lock:
            now = time.monotonic()
            if now - self._last_stall_warning < self.stall_warning_s / 2:
                return  # another waiting thread has just warned of the same stall
            self._last_stall_warning = now
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

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future:
        """Start a client coroutine on the engine's loop; returns a `concurrent.futures.Future`."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def generate(
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
                self.run(
                    self.client.generate_batch(
                        [prompts[i] for i in todo],
                        [per_prompt[i] for i in todo],
                        return_routed_experts=return_routed_experts,
                        done=finished,
                    )
                )
                done.update({todo[j]: sample for j, sample in finished.items()})
                return [done[i] for i in range(len(prompts))]
            except EngineDiedError as err:
                done.update({todo[j]: sample for j, sample in finished.items()})
                restart = functools.partial(self._restart_dead_engine, err, serving, len(prompts) - len(done))
                if self.handoff is None:
                    restart()
                else:
                    self.handoff.call(restart, "restarting the rollout engine")

    def _restart_dead_engine(self, err: EngineDiedError, dead: LocalEngineProcess | None, unfinished: int) -> None:
        """Start the local engine again in place of `dead` and give it the current weights, unless
        another thread's report of the same death did already; raises `EngineDiedError` with the
        log's tail once `max_restarts` are used up."""
        with self._restart_lock:
            if dead is not None and dead is not self.local_process:
                return  # restarted meanwhile: send again
            self._set_weights_current(False)
            try:
                self._restart_locked(err, unfinished)
            finally:
                self._set_weights_current(True)

    def _set_weights_current(self, current: bool) -> None:
        """Set or clear the client's `weights_current` on its loop, and wait until that is done."""
        gate = self.client.weights_current
        assert gate is not None

        async def flip() -> None:
            if current:
                gate.set()
            else:
                gate.clear()

        self.submit(flip()).result(CLIENT_THREAD_JOIN_S)

    def _restart_locked(self, err: EngineDiedError, unfinished: int) -> None:
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
        self.local_process = self._restart(dead)
        if self.resync is not None:
            self.resync()

    def close(self) -> None:
        try:
            self.submit(_cancel_pending()).result(30)  # e.g. a generate interrupted by Ctrl-C
            self.run(self.client.close(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLIENT_THREAD_JOIN_S)
            if self.local_process is not None:  # first: a stuck client thread must not leave the engine running
                self.local_process.stop()
            if self._thread.is_alive():  # a running loop cannot be closed; the daemon thread ends with the process
                log.warning("the rollout client's thread did not stop within %.0f s", CLIENT_THREAD_JOIN_S)
            else:
                self._loop.close()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait until they have finished."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
