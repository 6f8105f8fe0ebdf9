"""Aborting the episodes of an event loop: a preempted run's step ends within a bounded time.

After SIGTERM/SIGUSR1 the trainer finishes the step in progress and saves its checkpoint; an episode
may wait long (an agent up to `env.agent_timeout_s`, an environment step up to `env.step_timeout_s`),
so `checkpoint.preempt_timeout_s` after the signal the rollout runtime calls `abort_episodes` on its
loop. From then on each episode awaited through `abortable` ends at once (`EpisodesAborted`: its work
cancelled, an agent command's processes killed), also one that starts later; the episode's
trajectory is an abort (its group is left out). One flag per event loop, set once: the run stops
after that step.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
_ABORTED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Event] = weakref.WeakKeyDictionary()


class EpisodesAborted(Exception):
    """The running loop's episodes were aborted (a preemption's grace time is running out)."""


def _event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    if loop not in _ABORTED:
        _ABORTED[loop] = asyncio.Event()
    return _ABORTED[loop]


def abort_episodes() -> None:
    """(On the loop.) End every episode awaited through `abortable` on the running loop, now and later."""
    _event().set()


def episodes_aborted() -> bool:
    """(On the loop.) Whether `abort_episodes` ran on the running loop."""
    return _event().is_set()


async def abortable(work: Awaitable[T], on_abort: Callable[[], T] | None = None) -> T:
    """`work`'s result; once the running loop's episodes are aborted, `work` is cancelled (and awaited)
    and this is `on_abort()`, or without it `EpisodesAborted`."""
    aborted = _event()
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(aborted.wait())
    try:
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done() and (aborted.is_set() or asyncio.current_task().cancelling()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled() and on_abort is not None:
        return on_abort()
    if task.cancelled():
        raise EpisodesAborted("the episode was aborted: the run is stopping (checkpoint.preempt_timeout_s)")
    return task.result()
