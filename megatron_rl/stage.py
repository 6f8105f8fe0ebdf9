"""One training stage on every rank, shaped like torchtitan's `Trainer(Stateful)`: the RL loop
(`trainer.Trainer`) and the supervised stage (`sft.stage.SFTStage`) are its two kinds.

`Stage.launch` is a stage's whole life in one process (one rank of a torchrun/srun launch, or a
world of one): the configuration validated, once per launch (`validation.validate_run`: the entry
points call `launch`, and nothing below it validates again); `start`, which builds the pieces into
one `ExitStack` that closes each, the last started first, on every way out, torch.distributed last of
all (the launch's one teardown); then `run`, the only loop. A stage supplies what differs: `step`,
`evaluate`, and `state_dict`/`load_state_dict`, its named entries of the checkpoint
(`checkpoints.LoopState.entries`), restored by `RunFolder.restore` at the end of its start; `models`, the
distributed models it trains beside the actor (the RL stage's critic), each saved into the checkpoint's
folder of its name and loaded from it on resume (`RunFolder.resume_model`).

The loop (docs/architecture.md, "Who runs what"): a step; evaluation every `eval.every` steps and
at the last (`eval_due`); the record logged before the checkpoint, so that a run resumed from step k
keeps the records up to k; the stop signal (SIGTERM/SIGUSR1, `parallel.signals`) agreed by every rank
at each step boundary; a checkpoint every `checkpoint.every` steps, at the last one and at a stop;
after the last step, `finish` (the final export).
"""

from __future__ import annotations

import contextlib
import signal
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.metrics import MetricsLogger
from megatron_rl.parallel.signals import StoppedBySignal, StopRequest, exit_code, stop_at_step_boundary
from megatron_rl.run_folder import CheckpointedModel, ResumeMode, RunFolder
from megatron_rl.validation import Command, validate_run

if TYPE_CHECKING:
    from typing import Self

    from megatron_rl.actor.actor import MegatronActor


def tear_down_distributed() -> None:
    """Megatron's groups and torch.distributed, once the actor's start made them (the launch's one teardown)."""
    from megatron_rl.parallel import destroy_distributed

    if dist.is_initialized():
        destroy_distributed()


class Stage(ABC):
    """One stage on one rank: its run folder, actor and step log, and the loop (see the module doc)."""

    command: ClassVar[Command]
    log_prefix: ClassVar[str] = ""  # what the stage's own lines start with ("sft: ")
    evaluates_first: ClassVar[bool] = False  # an evaluation (step 0) before a run's first step

    def __init__(self, cfg: Config, run_folder: RunFolder, actor: MegatronActor, log: MetricsLogger) -> None:
        self.cfg = cfg
        self.run_folder = run_folder
        self.actor = actor
        self.log = log
        self.stopped_by = 0  # the stop signal `run` ended on (0: it ran every step)

    @classmethod
    def launch(cls, cfg: Config, *, resume: ResumeMode = False, force: bool = False) -> dict[str, Any]:
        """Validate `cfg`, start the stage, run it and tear it down; the last step's record (rank 0's
        rollout metrics on every rank). With `resume`, continue from the newest complete checkpoint;
        with `force`, a run folder that holds a run is moved aside (`run_folder.RunFolder`). Raises
        `StoppedBySignal` (a SystemExit) after the checkpoint of a run stopped by SIGTERM/SIGUSR1."""
        cfg = validate_run(cfg, cls.command)
        with stop_at_step_boundary() as stop_request, contextlib.ExitStack() as stack:
            stack.callback(tear_down_distributed)  # registered first: run last, after every piece is closed
            stage = cls.start(cfg, stack, resume=resume, force=force)
            record = stage.run(stop_request)
        if stage.stopped_by:
            raise StoppedBySignal(exit_code(stage.stopped_by))
        return record

    @classmethod
    @abstractmethod
    def start(cls, cfg: Config, stack: contextlib.ExitStack, *, resume: ResumeMode, force: bool) -> Self:
        """Start every piece of the stage on a validated `cfg`, collectively; `stack` closes each."""

    @abstractmethod
    def step(self, step: int) -> dict[str, Any]:
        """Train step `step` (collective); its record (with "step")."""

    @abstractmethod
    def evaluate(self, step: int) -> dict[str, float]:
        """The evaluation after `step` (collective; {} when there is nothing to report)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The stage's named entries of a checkpoint's loop state (rank 0's are written)."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s entries, as a resumed checkpoint holds them."""

    def models(self) -> dict[str, CheckpointedModel]:
        """The models besides the actor that a checkpoint holds, by folder name (collective saves)."""
        return {}

    def eval_due(self, step: int) -> bool:
        """Whether `step` ends with an evaluation (the same answer on every rank)."""
        every = self.cfg.eval.every
        return bool(every) and (step % every == 0 or step == self.cfg.train.steps)

    @contextlib.contextmanager
    def holding_still(self) -> Iterator[None]:
        """Around a checkpoint: what must not move while `state_dict` is taken and written."""
        yield

    @abstractmethod
    def on_stop(self, stop_request: StopRequest) -> None:
        """Before the loop: what a stop signal starts, so that the step in progress ends within a bound."""

    @abstractmethod
    def finish(self) -> None:
        """After the last step (not after a stop): the final export."""

    def run(self, stop_request: StopRequest | None = None) -> dict[str, Any]:
        """Train from the resumed step to `train.steps`; the last step's record. `stop_request`
        (SIGTERM/SIGUSR1) ends the run at a step boundary with a checkpoint."""
        cfg = self.cfg
        start_step = self.run_folder.start_step
        started = time.perf_counter()
        if self.evaluates_first and start_step == 0 and cfg.eval.every:
            self.log.log({"step": 0, **self.evaluate(0)}, advance=False)
        if stop_request is not None:
            self.on_stop(stop_request)
        stop = stop_request.agreed() if stop_request is not None else 0
        if stop and start_step < cfg.train.steps:  # a signal during the start-up: nothing new to save
            self.stopped_by = stop
            self.log.message(f"{self.log_prefix}{signal.Signals(stop).name}: stopped before step {start_step + 1}")
            return {}
        if start_step >= cfg.train.steps:
            self.log.message(
                f"{self.log_prefix}the run is already at step {start_step} of train.steps = {cfg.train.steps}: "
                "no step left to train (raise train.steps to train on)"
            )
        record: dict[str, Any] = {}
        checkpoint_s = None
        for step in range(start_step + 1, cfg.train.steps + 1):
            record = self.step(step)
            last = step == cfg.train.steps
            if self.eval_due(step):
                record.update(self.evaluate(step))
            if checkpoint_s is not None:
                record["time/checkpoint"], checkpoint_s = checkpoint_s, None
            record["time/elapsed"] = time.perf_counter() - started
            self.log.log(record)  # before the checkpoint: resuming from step k keeps the records up to k
            stop = stop_request.agreed() if stop_request is not None else 0
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last or stop:
                began = time.perf_counter()
                folder = self._save(step)
                checkpoint_s = time.perf_counter() - began
            if stop and not last:
                self.stopped_by = stop
                self.log.message(
                    f"{self.log_prefix}{signal.Signals(stop).name}: stopped after step {step} of {cfg.train.steps}; "
                    f"checkpoint {folder}; continue with --resume"
                )
                return record
        self.finish()
        return record

    def _save(self, step: int) -> Path:
        with self.holding_still():
            return self.run_folder.save_checkpoint(self.actor, step, self.state_dict(), models=self.models())
