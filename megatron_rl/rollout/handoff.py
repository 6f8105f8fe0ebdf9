"""Calls the rollout side hands to the trainer's main thread.

What belongs to the main thread (the weight sync's state: a restarted engine's resync, a collective of
every trainer rank) is never touched by the rollout runtime's event loop. A coroutine on the loop hands
the call over with `submit` and awaits its future; the main thread runs the calls handed to it wherever
it waits for rollout work (`wait_for`, `wait_future`: every call it makes into the rollout runtime),
which is its next safe point. A call submitted on the main thread itself runs at once.

`cond` is the lock and condition of that waiting: a call handed over, or the rollout work finishing,
wakes the waiting main thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class HandoffClosedError(RuntimeError):
    """The run is ending: a call handed to the main thread will not run."""


class MainThreadCalls:
    """Calls handed from the rollout loop to the thread that built this object (see the module doc)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.owner = threading.current_thread()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._closed = False

    def submit(self, fn: Callable[[], T], what: str) -> Future[T]:
        """`fn()` on the main thread, at its next `wait_for` (at once when called on it); its future (failed
        with `HandoffClosedError` if the run ends first). `what` names the call in the warnings."""
        future: Future[T] = Future()
        if threading.current_thread() is self.owner:
            _run_into(future, fn)
            return future
        with self.cond:
            if self._closed:
                raise HandoffClosedError(f"{what}: the run is ending")
            self._calls.append((fn, future))
            self.cond.notify_all()
        return future

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

    def wait_future(self, future: Future[T], timeout: float) -> T:
        """(The main thread.) `future`'s result, running the calls handed over until it is done; TimeoutError
        after `timeout` seconds."""
        future.add_done_callback(lambda _: self.notify())
        with self.cond:
            if not self.wait_for(future.done, timeout):
                raise TimeoutError(f"no result from the rollout runtime within {timeout:.0f} s")
        return future.result()

    def _run_handed(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            self.cond.release()
            try:
                _run_into(future, fn)
            finally:
                self.cond.acquire()

    def notify(self) -> None:
        """Wake the main thread's `wait_for` (what it waits for may have changed)."""
        with self.cond:
            self.cond.notify_all()

    def close(self) -> None:
        """Calls not run yet fail (`HandoffClosedError`) in the coroutines that handed them over."""
        with self.cond:
            self._closed = True
            calls, self._calls = self._calls, deque()
            self.cond.notify_all()
        for _, future in calls:
            future.set_exception(HandoffClosedError("the run is ending"))


def _run_into(future: Future[T], fn: Callable[[], T]) -> None:
    try:
        future.set_result(fn())
    except BaseException as err:  # the coroutine that handed it over raises it
        future.set_exception(err)
