"""The one event loop of the rollout side, on a thread of its own ("rollout-runtime").

Rank 0's rollout runtime (`megatron_rl.loop.runtime`) creates one; the engine client, its restart
supervision, the agents' gateway, the remote-reward client and every episode run on it. Synchronous
code (the trainer's main thread, a reward-scoring thread, SFT's evaluation) hands it a coroutine with
`run(coro, timeout)`; the main thread passes its `MainThreadCalls` so that it runs what the loop hands
it (a restarted engine's resync) while it waits. Nothing may block the loop's own thread: a call from
it to `run` raises at once instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from megatron_rl.rollout.handoff import MainThreadCalls

T = TypeVar("T")
log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 30.0  # how long `close` waits for the loop's tasks to end, then for its thread


class RolloutLoop:
    """An event loop running on its own daemon thread until `close` (see the module doc)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="rollout-runtime", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.close()

    def on_loop(self) -> bool:
        """Whether the calling thread is the loop's."""
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop (from any other thread); its future."""
        if self.on_loop():
            coro.close()
            raise RuntimeError("RolloutLoop.submit from the loop's own thread: await the coroutine instead")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, handoff: MainThreadCalls | None = None) -> T:
        """`coro`'s result; TimeoutError (the coroutine cancelled) after `timeout` seconds. On the thread that
        owns `handoff`, the calls handed to it run while it waits."""
        future = self.submit(coro)
        try:
            if handoff is not None and threading.current_thread() is handoff.owner:
                return handoff.wait_future(future, timeout)
            return future.result(timeout)
        except (TimeoutError, concurrent.futures.TimeoutError):
            if not future.done():
                future.cancel()
                raise TimeoutError(f"the rollout loop gave no result within {timeout:.0f} s") from None
            raise

    def close(self) -> None:
        """Cancel every task still on the loop, wait for them, then stop the loop and its thread (each wait
        at most `CLOSE_TIMEOUT_S`)."""
        if not self._thread.is_alive():
            return
        try:
            self.submit(_cancel_pending()).result(CLOSE_TIMEOUT_S)
        except Exception as err:  # closing on an error path: the run's own error is the one reported
            log.warning("rollout loop: closing: %s: %s", type(err).__name__, err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():  # a stuck callback: the daemon thread ends with the process
            log.warning("the rollout loop's thread did not stop within %.0f s", CLOSE_TIMEOUT_S)

    def __enter__(self) -> RolloutLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_pending() -> None:
    """Cancel every other task of the running loop and wait until they have finished."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
