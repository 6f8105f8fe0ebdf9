"""The thread that owns the model: generation steps, and every change to weights or state in between.

HTTP handlers never touch the model. They submit requests (`submit`) or commands (`call`), which
the thread runs between two generation steps, so a weight update never races a forward pass.
Both return `concurrent.futures.Future`s that an event loop can await.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from megatron_rl.rollout.local.generator import Generator, GenRequest
from megatron_rl.rollout.local.model import ModelInfo
from megatron_rl.rollout.local.weights import CheckpointLayout

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode


class EngineStateError(RuntimeError):
    """The engine cannot do this now (memory released, requests running, ...)."""


class EngineThread:
    """Runs a `Generator` in a background thread and serialises every command with its steps."""

    def __init__(self, model: torch.nn.Module, info: ModelInfo, generator: Generator, stats_every_s: float = 10.0):
        self.model, self.info, self.generator = model, info, generator
        self.layout = CheckpointLayout(model, info.family)
        self.paused = False
        self.released: set[str] = set()
        self._futures: dict[GenRequest, Future] = {}
        self._commands: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._stats_every_s = stats_every_s
        self._tokens_since, self._stats_at = 0, time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)

    @property
    def weight_version(self) -> str:
        return self.generator.weight_version

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(None)
        self._thread.join(timeout=30)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    # ---- called from other threads ----
    def submit(self, requests: list[GenRequest]) -> list[Future]:
        """Queue requests for generation; each future resolves to its finished `GenRequest`."""
        futures = [Future() for _ in requests]

        def add(engine: EngineThread) -> None:
            if engine.released & {"weights", "kv_cache"}:
                error = EngineStateError(
                    f"memory is released ({sorted(engine.released)}): call /resume_memory_occupation first"
                )
                for fut in futures:
                    fut.set_exception(error)
                return
            for req, fut in zip(requests, futures, strict=True):
                engine._futures[req] = fut
                engine.generator.add(req)

        self.call(add)
        return futures

    def call(self, fn: Callable[[EngineThread], Any]) -> Future:
        """Run `fn(engine)` in the engine thread between two steps; the future holds its result."""
        fut: Future = Future()
        self._commands.put((fn, fut))
        return fut

    # ---- engine-thread helpers for commands ----
    def abort(self, match: Callable[[GenRequest], bool], message: str = "Abort request") -> int:
        done = self.generator.abort(match, message)
        self._resolve(done)
        return len(done)

    def pause(self, mode: str) -> int:
        """Stop generating until `resume()`, as SGLang's /pause_generation `mode` does: "abort" finishes
        every request (aborted, with its tokens so far); "retract" sends the running ones back to the
        queue with their tokens, to be prefilled again (under the weights served then) on resume;
        "in_place" leaves them running with their KV cache. Returns the requests aborted or retracted."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}; allowed: {', '.join(PAUSE_MODES)}")
        self.paused = True
        if mode == "abort":
            return self.abort(lambda r: True)
        if mode == "retract":
            return self.generator.retract()
        return 0

    def resume(self) -> None:
        self.paused = False

    def _resolve(self, done: list[GenRequest]) -> None:
        for req in done:
            fut = self._futures.pop(req, None)
            if fut is not None and not fut.done():
                fut.set_result(req)
            self._tokens_since += len(req.output_ids)

    # ---- the loop ----
    def _run(self) -> None:
        while not self._stop.is_set():
            busy = self.generator.has_work and not self.paused
            try:
                item = self._commands.get(block=not busy, timeout=None if not busy else 0)
            except queue.Empty:
                item = False
            if item is None:
                break
            if item:
                self._execute(*item)
                continue
            if busy:
                try:
                    self._resolve(self.generator.step())
                except Exception as err:  # a failing forward must not leave callers waiting forever
                    log.exception("generation step failed; aborting the running requests")
                    self.abort(lambda r: True, f"engine error: {err}")
                self._report()
        self.abort(lambda r: True, "engine shutting down")

    def _execute(self, fn: Callable[[EngineThread], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self))
        except BaseException as err:  # handed to the caller, who turns it into an HTTP error
            fut.set_exception(err)

    def _report(self) -> None:
        now = time.monotonic()
        if now - self._stats_at < self._stats_every_s:
            return
        rate = self._tokens_since / (now - self._stats_at)
        log.info(
            "running %d, waiting %d, %.1f tokens/s, weight version %s",
            len(self.generator.running),
            len(self.generator.waiting),
            rate,
            self.weight_version,
        )
        self._tokens_since, self._stats_at = 0, now
