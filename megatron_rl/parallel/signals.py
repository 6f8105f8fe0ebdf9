"""Signals during a training stage: stop at the next step boundary, or at once.

- SIGTERM (a preemption, `scancel`, torchrun passing on its own SIGTERM) and SIGUSR1 (what
  `#SBATCH --signal=B:USR1@<grace>` makes the sbatch scripts send before the time limit) ask the
  loop to stop: the step in progress finishes, a checkpoint of it is saved, and the process exits
  (exit code 0 after SIGUSR1, a planned stop; 143 = 128 + SIGTERM after SIGTERM, as for any
  terminated process). The same signal a second time stops at once; the other one is taken as the
  same request (under Slurm a task can get SIGTERM from Slurm and SIGUSR1 from the batch script).
- SIGHUP raises `Terminated` at once, as Ctrl-C (SIGINT) raises KeyboardInterrupt: nothing is saved,
  the stage's `ExitStack` stops the engine (after Ctrl-C the command exits with code 130 and one line,
  no traceback: `megatron_rl.commands.stage`). Ctrl-C is remembered (`interrupted`): an error a rank
  ends with after it (a collective whose peer stopped, a checkpoint save it cut short) is the
  interruption, not a failure of its own.

The ranks agree at the boundary (`StopRequest.agreed`, one all-reduce): a signal that reached only
rank 0 (torchrun's workers signalled one by one, `kill` by hand) stops every rank after the same step.

`remember_stop_signals` (the first thing `megatron-rl train`/`sft` do) covers the slow start-up
before the stage's loop: a stop signal then is remembered instead of killing the process (SIGUSR1's
default action), and the stage stops at its first boundary. It also installs the SIGINT handler that
remembers Ctrl-C.

`StopRequest.on_stop` callbacks run when the first stop signal arrives: rank 0's rollout uses one to
abort the step's episodes `checkpoint.preempt_timeout_s` later, so that a step waiting for slow agents
still ends, and saves its checkpoint, within a preemption's grace time.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


_EARLY: list[int] = []  # stop signals received before `stop_at_step_boundary`
_INTERRUPTED: list[int] = []  # SIGINT, once received


def remember_stop_signals() -> None:
    """Until a stage enters `stop_at_step_boundary`, SIGTERM and SIGUSR1 are remembered for it; SIGINT
    is remembered (`interrupted`) and raises KeyboardInterrupt, as Python's own handler does."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, lambda signum, frame: _EARLY.append(signum))
    signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, frame: Any) -> None:
    _INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether this process received SIGINT since `remember_stop_signals`."""
    return bool(_INTERRUPTED)


class Terminated(SystemExit):
    """SIGHUP, or the same stop signal twice: unwinds like Ctrl-C so that the engine child is stopped."""


class StoppedBySignal(SystemExit):
    """The stage stopped after a checkpoint because of a stop signal; the exit code says which."""


def exit_code(signum: int) -> int:
    """0 after SIGUSR1 (Slurm's planned stop before the time limit), 128 + signum otherwise."""
    return 0 if signum == signal.SIGUSR1 else 128 + signum


class StopRequest:
    """The stop signal this process received (its number), if any; see the module docstring."""

    def __init__(self) -> None:
        self.signum = 0
        self._callbacks: list[Callable[[], None]] = []

    def on_stop(self, callback: Callable[[], None]) -> None:
        """`callback()` when the first stop signal arrives (at once if one already did). It runs in the
        signal handler, on the main thread: it must only hand work to another thread or loop."""
        self._callbacks.append(callback)
        if self.signum:
            callback()

    def handle(self, signum: int, frame: Any) -> None:
        if self.signum == signum:
            raise Terminated(128 + signum)
        if self.signum:
            return
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"received {name}: stopping after the current step with a checkpoint (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        for callback in self._callbacks:
            callback()

    def agreed(self) -> int:
        """The stop signal any rank received (0 = none); collective when torch.distributed runs."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        from megatron_rl.parallel.device import local_device

        flag = torch.tensor([self.signum], dtype=torch.int64, device=local_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


@contextlib.contextmanager
def stop_at_step_boundary() -> Iterator[StopRequest]:
    """Within the block: SIGTERM and SIGUSR1 set the returned request, SIGHUP raises `Terminated`."""
    request = StopRequest()
    request.signum = _EARLY[0] if _EARLY else 0
    _EARLY.clear()

    def hang_up(signum: int, frame: Any) -> None:
        raise Terminated(128 + signum)

    handlers = {sig: request.handle for sig in STOP_SIGNALS} | {signal.SIGHUP: hang_up}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
