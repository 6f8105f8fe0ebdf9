"""Calls a rollout worker thread hands to the trainer's main thread.

What belongs to the main thread (the weight sync's state: a restarted engine's resync) is never
touched by the threads that generate (the rollout runtime's generation threads). A worker hands the
call over with `call` and waits for its result; the main thread runs the calls handed to it wherever
it waits for rollout work (`wait_for`, `wait_future`: every call it makes into the rollout runtime),
which is its next safe point. A call made on the main thread itself runs at once.

`cond` is the lock and condition of that waiting: a call handed over, or the rollout work finishing,
wakes the waiting main thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)
# a worker waits this long at a time for the main thread (which may be in a long training step),
# warning after each wait, until the call ran or the hand-off is closed
HANDOFF_WARN_S = 60.0


class HandoffClosedError(RuntimeError):
    """The run is ending: a call handed to the main thread will not run."""


@dataclass
class _Call:
    fn: Callable[[], Any]
    what: str
    done: bool = False
    result: Any = None
    error: BaseException | None = None


class MainThreadCalls:
    """Calls handed from worker threads to the thread that built this object (see the module doc)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.owner = threading.current_thread()
        self._calls: deque[_Call] = deque()
        self._closed = False

    def call(self, fn: Callable[[], T], what: str) -> T:
        """`fn()` on the main thread: at once on it, else at its next `wait_for` (this thread waits)."""
        if threading.current_thread() is self.owner:
            return fn()
        handed = _Call(fn, what)
        with self.cond:
            if self._closed:
                raise HandoffClosedError(f"{what}: the run is ending")
            self._calls.append(handed)
            self.cond.notify_all()
            began = time.monotonic()
            while not handed.done:
                if self._closed:
                    raise HandoffClosedError(f"{what}: the run is ending")
                if not self.cond.wait(HANDOFF_WARN_S) and not handed.done:
                    log.warning("%s: waiting %.0f s for the trainer's main thread", what, time.monotonic() - began)
        if handed.error is not None:
            raise handed.error
        return handed.result

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """(The main thread, holding `cond`.) Wait until `predicate()` holds, at most `timeout` seconds,
        running the calls handed over meanwhile (with `cond` released); whether it holds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._run_handed()
            if predicate():
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            self.cond.wait(left)

    def wait_future(self, future: Future[T]) -> T:
        """(The main thread.) `future`'s result, running the calls handed over until it is done (the
        work behind it bounds its own waits)."""
        future.add_done_callback(lambda _: self.notify())
        with self.cond:
            self.wait_for(future.done, None)
        return future.result()

    def _run_handed(self) -> None:
        while self._calls:
            handed = self._calls.popleft()
            self.cond.release()
            try:
                handed.result = handed.fn()
            except BaseException as err:  # the worker that handed it over raises it
                handed.error = err
            finally:
                self.cond.acquire()
            handed.done = True
            self.cond.notify_all()

    def notify(self) -> None:
        """Wake the main thread's `wait_for` (what it waits for may have changed)."""
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        """Calls not run yet fail (`HandoffClosedError`) in the threads that handed them over."""
        with self.cond:
            self._closed = True
            self.cond.notify_all()


def run_serving_handoff(handoff: MainThreadCalls | None, work: Callable[[], T]) -> T:
    """`work()`. On the thread that owns `handoff` (the trainer's main thread), `work` runs on a thread
    of its own while this one runs what `work`'s generating threads hand it (a dead local engine's
    restart and resync), which would otherwise wait for it forever."""
    if handoff is None or threading.current_thread() is not handoff.owner:
        return work()
    with ThreadPoolExecutor(1, thread_name_prefix="rollout-work") as pool:
        return handoff.wait_future(pool.submit(work))


def blocking(engine: Any, make: Callable[[], Awaitable[T]]) -> T:
    """A rollout coroutine (`make()`) run from synchronous code on an event loop of its own: on the
    trainer's main thread (the owner of `engine.handoff`), on a thread beside it while it runs what the
    engine hands it (`run_serving_handoff`). The rollout runtime awaits the coroutines instead."""
    return run_serving_handoff(getattr(engine, "handoff", None), lambda: asyncio.run(make()))
