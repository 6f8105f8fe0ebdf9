"""Reward functions in worker processes, each response under a time limit.

`RewardWorkers` owns a pool of `workers` spawned processes running one reward function: a built-in
rule's name (dapo, boxed, math_verify) or `module:function` / `path/to/file.py:function`, as
`registry.load_reward_function` takes. `RewardScorer` scores local rules through it (`score`, which
blocks), the reward server (`server.py`) its requests (`submit`: the futures of a request's chunks).
The pool starts at the first batch, so code that builds one but never scores spawns nothing.

A worker runs the items of a chunk one at a time in its main thread, each under SIGALRM
(`item_timeout_s`): a function that hangs in Python code fails its item with a TimeoutError and the
worker goes on with the next, and math-verify's own SIGALRM timeouts work there too (in a thread of
the trainer they are off). A C call that holds the interpreter is interrupted only when it returns.

`score` also watches the workers from the calling process: each worker writes, in memory shared with
its pool, when its current item started.

- An item still running `NUDGE_S` after its limit gets SIGALRM again, from the parent (the function
  cancelled or replaced the worker's timer, as math-verify's own timeouts do).
- One still running `KILL_GRACE_S` after its limit blocks SIGALRM or sits in a C call that does not
  return: once the batch's other chunks are done, the pool's processes are killed, the items of the
  unfinished chunks count as timeouts, and the next batch starts a new pool.
- No item running for `START_SLACK_S` while chunks wait (workers that cannot start or import the
  function): the same.

A worker process that dies fails its chunk's items (BrokenProcessPool) and a new pool starts. So a
batch never waits forever. `close` ends the processes; a worker whose parent died exits by itself
within a second. A worker ignores the signals a terminal or a launcher sends the whole process group
(`GROUP_SIGNALS`: Ctrl-C, torchrun's SIGTERM, ...), from its first instruction on (they are blocked in
the thread that spawns it): the process that owns the pool decides when it ends.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, suppress
from typing import Any

from megatron_rl.rewards.protocol import ItemError, RewardItem, RuleOutput
from megatron_rl.rewards.registry import RuleCall, load_reward_function, rule_caller

log = logging.getLogger(__name__)

# one item's result: the function's output, or its failure (the message; `timeout` when it ran too long)
ItemResult = RuleOutput | ItemError
GROUP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP}

# ---- in the worker process ----

_call: RuleCall | None = None
_timeout_s = 0.0
_timeout_name = ""
_board: Any = None  # the pool's item start times (shared memory), one slot per worker process
_slot = -1
_item_started: float | None = None


class ItemTimeoutError(TimeoutError):
    """The worker's own limit on one item (not a TimeoutError the function raised itself)."""


def _init_worker(spec: str, where: str, item_timeout_s: float, timeout_name: str, board: Any = None) -> None:
    """A worker's start: claim a slot of the board, arm SIGALRM's handler, load the function."""
    global _call, _timeout_s, _timeout_name, _board, _slot
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # discards one that arrived while blocked
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM, *GROUP_SIGNALS})  # the spawning thread's mask
    if board is not None:
        starts, pids, claimed = board
        with claimed.get_lock():
            slot, claimed.value = claimed.value, claimed.value + 1
        if slot < len(starts):
            pids[slot] = os.getpid()
            _board, _slot = starts, slot
    _timeout_s, _timeout_name = item_timeout_s, timeout_name
    if item_timeout_s > 0:
        signal.signal(signal.SIGALRM, _item_timed_out)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="exit-with-parent", daemon=True).start()
    _call = rule_caller(load_reward_function(spec, where))


def _exit_with_parent(parent: int) -> None:
    """End this worker when its parent is gone (killed without closing the pool): nothing else would."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the main thread's, to interrupt its item
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _item_timed_out(signum: int, frame: Any) -> None:
    started = _item_started
    if started is None or time.monotonic() - started < _timeout_s - 1e-3:
        return  # a late alarm: between items, or the parent's nudge crossing the item's end
    raise ItemTimeoutError(f"the reward function ran longer than {_timeout_name} = {_timeout_s:g} s")


def _run_item(item: RewardItem) -> Any:
    global _item_started
    assert _call is not None, "score_items runs in a worker started by _init_worker"
    _item_started = time.monotonic()
    if _slot >= 0:
        _board[_slot] = _item_started
    if _timeout_s > 0:
        signal.setitimer(signal.ITIMER_REAL, _timeout_s)
    try:
        return _call(item.response, item.answer, item.prompt, item.row)
    finally:
        _item_started = None  # first: an alarm from here on is ignored
        if _slot >= 0:
            _board[_slot] = 0.0
        if _timeout_s > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)


def score_items(items: Sequence[RewardItem]) -> list[ItemResult]:
    """In a worker process: per item, the function's checked output or its failure."""
    results: list[ItemResult] = []
    for item in items:
        began = time.monotonic()
        try:
            results.append(RuleOutput.of(_run_item(item)))
        except (Exception, SystemExit) as err:  # the function's failure is this item's result, not the chunk's
            ours = isinstance(err, ItemTimeoutError)
            timeout = ours or (_timeout_s > 0 and time.monotonic() - began >= _timeout_s)
            results.append(ItemError(f"{'TimeoutError' if ours else type(err).__name__}: {err}", timeout))
    return results


# ---- in the calling process ----


@contextmanager
def _signals_blocked(signals: set[signal.Signals]) -> Iterator[None]:
    """`signals` blocked in this thread within the block (one that arrives meanwhile is delivered after)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Pool:
    """One spawn ProcessPoolExecutor and its board: per worker slot, when its current item started
    (0: none running) and its pid."""

    def __init__(self, spec: str, where: str, workers: int, item_timeout_s: float, timeout_name: str) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process that runs threads or an event loop
        self.starts = context.Array("d", workers, lock=False)
        self.pids = context.Array("i", workers, lock=False)
        board = (self.starts, self.pids, context.Value("i", 0))
        self.executor = ProcessPoolExecutor(
            workers,
            mp_context=context,
            initializer=_init_worker,
            initargs=(spec, where, item_timeout_s, timeout_name, board),
        )

    def processes(self) -> list[Any]:
        return list((self.executor._processes or {}).values())  # no public accessor before Python 3.14

    def running(self) -> list[tuple[int, float]]:
        """(pid, start time) of each item running now in one of this pool's processes."""
        ours = {p.pid for p in self.processes()}
        pids = self.pids[:]
        return [(pids[i], t) for i, t in enumerate(self.starts[:]) if t > 0 and pids[i] > 0 and pids[i] in ours]

    def kill(self) -> None:
        """Kill the processes at once (work in them is lost) and shut the executor down."""
        processes = self.processes()
        for process in processes:
            process.kill()
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.join(5.0)

    def close(self, wait_s: float = 5.0) -> None:
        """Let the processes finish their chunk and exit; kill the ones still there after `wait_s`."""
        processes = self.processes()
        self.executor.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + wait_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.exitcode is None:
                process.kill()
                process.join(5.0)


class RewardWorkers:
    """`workers` processes running the reward function `spec`, each item under `item_timeout_s`
    (0: no limit). `where` names the function in load errors, `timeout_name` the limit in timeouts."""

    START_SLACK_S = 120.0  # for the workers to spawn and import the function before an item runs
    NUDGE_S = 1.0  # an item this late past its limit gets SIGALRM again
    KILL_GRACE_S = 3.0  # an item this late past its limit is stuck: its pool is killed
    POLL_S = 0.1

    def __init__(
        self,
        spec: str,
        workers: int = 1,
        item_timeout_s: float = 0.0,
        *,
        where: str | None = None,
        timeout_name: str = "item_timeout_s",
    ) -> None:
        if workers < 1:
            raise ValueError(f"RewardWorkers: workers = {workers}, must be >= 1")
        self.spec, self.workers, self.item_timeout_s = spec, workers, item_timeout_s
        self.where, self.timeout_name = where or repr(spec), timeout_name
        self.restarts = 0  # pools replaced (a dead or stuck worker)
        self._lock = threading.Lock()  # guards the current pool
        self._scoring = threading.Lock()  # one `score` at a time: its waits are its own items'
        self._pool: _Pool | None = None
        self._closed = False

    def chunks(self, items: Sequence[RewardItem]) -> list[Sequence[RewardItem]]:
        """`items` split over the workers, in order."""
        size = max(1, math.ceil(len(items) / self.workers))
        return [items[i : i + size] for i in range(0, len(items), size)]

    def submit(self, items: Sequence[RewardItem]) -> tuple[_Pool, list[Future[list[ItemResult]]]]:
        """The pool and one future per chunk of `self.chunks(items)`; the pool starts on the first call."""
        chunks = self.chunks(items)
        for attempt in range(2):
            with self._lock:
                if self._closed:
                    raise RuntimeError(f"the reward workers of {self.where} are closed")
                if self._pool is None:
                    self._pool = _Pool(self.spec, self.where, self.workers, self.item_timeout_s, self.timeout_name)
                pool = self._pool
            try:
                with _signals_blocked(GROUP_SIGNALS):  # the processes a submit spawns inherit the mask
                    return pool, [pool.executor.submit(score_items, chunk) for chunk in chunks]
            except BrokenProcessPool:  # it broke while idle (a worker killed from outside): once on a new one
                self.restart(pool)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def restart(self, pool: _Pool) -> None:
        """Kill `pool`'s processes; the next batch starts a new pool (unless another call replaced it already)."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        pool.kill()

    def score(self, items: Sequence[RewardItem]) -> list[ItemResult]:
        """Per item, its result; a batch that a dead or stuck worker cannot finish returns too (see the module doc)."""
        if not items:
            return []
        with self._scoring:
            pool, futures = self.submit(items)
            reason, unfinished = self._wait(pool, futures)
            results: list[ItemResult] = []
            restart = reason is not None
            for chunk, future in zip(self.chunks(items), futures, strict=True):
                if future in unfinished:
                    error = ItemError(f"TimeoutError: {reason}", timeout=True)
                elif future.cancelled():
                    error = ItemError(f"the reward workers of {self.where} were closed before scoring it")
                elif (exc := future.exception()) is None:
                    results += future.result()
                    continue
                elif isinstance(exc, BrokenProcessPool):
                    restart = True
                    error = ItemError(f"a reward worker process died (BrokenProcessPool: {exc}); new workers start")
                else:
                    error = ItemError(f"{type(exc).__name__}: {exc}")
                results += [error] * len(chunk)
            if restart:
                log.warning("reward workers of %s: %s; starting new ones", self.where, reason or "a worker died")
                self.restart(pool)
            return results

    def _wait(self, pool: _Pool, futures: list[Future[Any]]) -> tuple[str | None, set[Future[Any]]]:
        """Wait for `futures`: (None, {}) once all are done, else why the pool must go and the ones unfinished."""
        limit = self.item_timeout_s
        pending = set(futures)
        active = time.monotonic()  # when an item last ran or a chunk finished
        nudged: dict[int, float] = {}
        while pending:
            done, pending = wait(pending, timeout=self.POLL_S)
            now = time.monotonic()
            running = pool.running()
            if done or running:
                active = now
            stuck = 0
            for pid, started in running if limit > 0 else ():
                late = now - started - limit
                if late > self.KILL_GRACE_S:
                    stuck += 1
                elif late > self.NUDGE_S and now - nudged.get(pid, 0.0) >= self.NUDGE_S:
                    nudged[pid] = now
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGALRM)
            if pending and stuck and len(pending) <= stuck:  # only the stuck workers' chunks are left
                return (
                    f"the reward function ran longer than {self.timeout_name} = {limit:g} s and did not stop at "
                    "SIGALRM (it blocks the signal, or a C call does not return): its worker processes were killed",
                    pending,
                )
            if pending and now - active > self.START_SLACK_S:
                return (
                    f"no reward worker ran an item within {self.START_SLACK_S:g} s (they could not start or "
                    "import the function): the worker processes were killed",
                    pending,
                )
        return None, set()

    def close(self) -> None:
        """End the worker processes; later batches raise."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()
