"""A training stage's run folder (RL and SFT) on every rank: its refusals and lock, where it resumes
from, its step log, checkpoints and exports.

A fresh run (no `--resume`) refuses a run folder that already holds a run (step records in
metrics.jsonl, hf/ or checkpoint folders) unless `force` is given: then the old run folder is
renamed to RUN_DIR.old-N (and a CKPT_DIR outside it to CKPT_DIR.old-N), N the first free number;
nothing is deleted. The folders (and the RL stage's `rollout.sync_dir` of a disk weight sync) are
checked writable at start-up, before any step is trained. Rank 0 holds the run folder's lock
(`lock.RunLock`) from before anything is written until the stage ends: a second launch into the same
folder is refused, naming the pid of the first; a lock lost while the stage runs stops every rank
before its next record, checkpoint or export (`RunFolderError`).

`--resume` (`resume=True`) continues from the newest usable checkpoint (`checkpoints.resume_point`)
and refuses a run folder with none, naming what is wrong with each; `--resume-if-any`
(`resume=RESUME_IF_ANY`) also starts afresh a folder that holds no run, or the run of a job killed
before its first checkpoint was finished (no finished checkpoint folder, no record past the first
checkpoint's step: a Slurm requeue), whose records it drops; it refuses the others. Neither touches
a run folder it refuses. A resume reads metrics.jsonl before anything slow starts: a damaged line
before the last is refused there, naming the file and the line. Resuming drops the records of later
steps from metrics.jsonl (a torn last line too).

Every rank builds the `RunFolder` before torch.distributed starts, so each decides from the
shared file system: nothing is written into the run folder before every rank has passed its
checks (the actor start that follows is collective), and only rank 0 moves an old run aside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_rl.checkpoints import (
    ACTOR_DIR,
    STAGING_SUFFIX,
    CheckpointedModel,
    LoopState,
    checkpoint_dir,
    checkpoint_write_error,
    commit_checkpoint,
    prune_checkpoints,
    remove_staging,
    restore_rng,
    resume_point,
    staging_dir,
)
from megatron_rl.config import Config, ConfigError, to_dict, to_yaml
from megatron_rl.metrics import METRICS_FILE, MetricsLogger, read_metrics, truncate_metrics
from megatron_rl.parallel.rank0 import on_rank0
from megatron_rl.run_folder.layout import (
    aside,
    check_inputs_outside,
    check_writable,
    move_run_aside,
    moved_path,
    run_contents,
    sync_folder,
)
from megatron_rl.run_folder.lock import RunLock

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.checkpoints import Stateful

logger = logging.getLogger(__name__)

RESUME_IF_ANY = "if_any"  # --resume-if-any: resume when there is a checkpoint, start a folder without a run afresh
ResumeMode = bool | Literal["if_any"]


class RunFolderError(RuntimeError):
    """The stage lost its run folder while running (rank 0's lock file removed or replaced): raised on
    every rank alike, before anything more is written."""


def _nothing_to_resume(flag: str, run_dir: Path, ckpt_root: Path, found: list[Path], damaged: list[str]) -> str:
    """The refusal of a resume without a usable checkpoint (nothing was changed)."""
    if damaged:
        why = f"no usable checkpoint in {ckpt_root}: " + "; ".join(damaged)
    else:
        why = f"no checkpoint in {ckpt_root}"
    metrics = run_dir / METRICS_FILE
    if metrics in found:
        why += f" (and {metrics} holds {len(read_metrics(run_dir, warn=False))} step records)"
    if found:
        return (
            f"{flag}: {why}; nothing was changed: repair the checkpoint, or pass --force to start afresh "
            f"with the run moved aside to {aside(run_dir)}"
        )
    return f"{flag}: {why}, nothing to resume: start without --resume (or pass --resume-if-any)"


class RunFolder:
    """One stage's run folder on every rank: where it resumes from, its logs, checkpoints and exports.

    Built before the actor: it finds the checkpoint to resume from and reads its loop state, so
    `start_step` is known from the start.
    """

    def __init__(
        self, cfg: Config, *, rank: int, resume: ResumeMode, force: bool = False, syncs_weights: bool = False
    ) -> None:
        """`resume`: True: continue from the newest complete checkpoint, refused without one;
        `RESUME_IF_ANY`: the same, but a folder that holds no run (or a run killed before its first
        checkpoint) starts afresh. Otherwise a run folder that holds a run is refused, unless `force`:
        then rank 0 moves the old run aside (nothing is deleted). `syncs_weights`: the stage sends its
        weights to engines (RL), so a disk sync's `rollout.sync_dir` is checked writable too. Rank 0
        locks the run folder until `close`."""
        if resume and force:
            raise ConfigError("--resume continues the run in logging.run_dir, --force moves it aside: pass one")
        self.cfg = cfg
        self.rank = rank
        self.resume = resume
        self.syncs_weights = syncs_weights
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.moved_aside: list[tuple[Path, Path]] = []
        self.dropped_records = 0  # --resume-if-any after a kill before the first checkpoint: its records
        self._lock: RunLock | None = None
        if rank == 0:  # before anything is read or written: a second launch waits for nothing
            check_writable(self.run_dir, "logging.run_dir")
            self._lock = RunLock(self.run_dir)
        try:
            self._open(force)
        except BaseException:
            self.close()
            raise

    def _open(self, force: bool) -> None:
        cfg, rank, resume = self.cfg, self.rank, self.resume
        found = run_contents(self.run_dir, self.ckpt_root)
        if not resume:
            if found and not force:
                shown = ", ".join(str(p) for p in found[:3]) + (
                    f" (and {len(found) - 3} more)" if len(found) > 3 else ""
                )
                raise ConfigError(
                    f"logging.run_dir = {str(self.run_dir)!r} already holds a run ({shown}): pass --resume to "
                    f"continue it, or --force to start afresh with the old run moved aside to "
                    f"{aside(self.run_dir)}"
                )
            if found:
                check_inputs_outside(cfg, [self.run_dir, self.ckpt_root])
            if found and rank == 0:
                self.moved_aside = move_run_aside(self.run_dir, self.ckpt_root)
        if rank == 0:  # the other ranks would race rank 0's move; the folders are shared
            check_writable(self.run_dir, "logging.run_dir")
            if self.moved_aside and self._lock is not None:  # the lock moved with the old run: lock the new folder
                old = self._lock
                old.path = moved_path(old.path, self.moved_aside)
                self._lock = RunLock(self.run_dir)
                old.release()
            check_writable(self.ckpt_root, "checkpoint.dir" if cfg.checkpoint.dir else "logging.run_dir")
            if self.syncs_weights and cfg.rollout.weight_sync == "disk":
                check_writable(sync_folder(cfg), "rollout.sync_dir", "the run could send the engine no weights")
        point = None
        if resume:
            flag = "--resume" if resume is True else "--resume-if-any"
            records = self._records(flag, found)
            damaged: list[str] = []
            point = resume_point(self.ckpt_root, warn=rank == 0, damaged=damaged)
            if point is None and (resume is True or found):
                if not self._stopped_before_its_first_checkpoint(found, records, damaged):
                    raise ConfigError(_nothing_to_resume(flag, self.run_dir, self.ckpt_root, found, damaged))
                self.dropped_records = len(records)
        self.resume_from = point[0] if point is not None else None
        # the newest checkpoint known to verify: pruning never removes it
        self.verified: Path | None = self.resume_from
        self.loop_state = point[1] if point is not None else None
        self.start_step = self.loop_state.step if self.loop_state is not None else 0
        saved_mode = self.loop_state.async_mode if self.loop_state is not None else None
        if saved_mode not in (None, "sync") and saved_mode != cfg.rollout.async_mode:
            raise ConfigError(
                f"rollout.async_mode = {cfg.rollout.async_mode!r} but {self.resume_from} was saved with "
                f"{saved_mode!r}, whose rollout state (pre-generated batch or buffer) this mode cannot continue; "
                f"resume with rollout.async_mode={saved_mode}"
            )
        if self.loop_state is not None and self.loop_state.rollout_seed != cfg.train.seed:
            logger.warning(
                "resuming with train.seed = %d, saved with %d: the rollouts will differ from the original run's",
                cfg.train.seed,
                self.loop_state.rollout_seed,
            )

    def _records(self, flag: str, found: list[Path]) -> list[dict[str, Any]]:
        """The step records a resume rewrites, read before anything slow starts: a damaged line (not a
        torn last one) is refused here, naming the file and the line, and nothing is changed."""
        if self.run_dir / METRICS_FILE not in found:
            return []
        try:
            return read_metrics(self.run_dir, warn=False)  # a torn last line: warned when it is dropped
        except (ValueError, OSError) as err:
            raise ConfigError(
                f"{flag}: {err}; the step records cannot be continued: repair or delete that line, then resume "
                "again (nothing was changed)"
            ) from None

    def _stopped_before_its_first_checkpoint(
        self, found: list[Path], records: list[dict[str, Any]], damaged: list[str]
    ) -> bool:
        """--resume-if-any without a usable checkpoint: whether the folder's run was stopped before its
        first checkpoint was finished (a requeued Slurm job), so that it starts afresh. It holds no
        finished checkpoint folder (damaged or not: only `.tmp` ones), no record past the step of the
        first checkpoint, and no hf/ export unless its records stop before the last step (SFT exports
        at its evaluations)."""
        cfg = self.cfg
        if self.resume != RESUME_IF_ANY or damaged:
            return False
        first = min(cfg.checkpoint.every or cfg.train.steps, cfg.train.steps)
        steps = [record.get("step") for record in records]
        if not all(isinstance(step, int) and step <= first for step in steps):
            return False
        exported = self.run_dir / "hf" in found and max(steps, default=0) >= cfg.train.steps
        metrics = self.run_dir / METRICS_FILE
        unfinished = [
            p for p in found if p not in (metrics, self.run_dir / "hf") and not p.name.endswith(STAGING_SUFFIX)
        ]
        return not exported and not unfinished

    def check_lock(self, before: str) -> None:
        """Collective: every rank raises `RunFolderError` when rank 0's lock on the run folder was lost
        (its file removed or replaced, so another launch may be writing here); `before`: what the
        stage was about to write, and will not."""
        lost = self._lock.lost() if self._lock is not None else None
        if dist.is_initialized() and dist.get_world_size() > 1:
            box = [lost]
            dist.broadcast_object_list(box, src=0)
            lost = box[0]
        if lost is not None:
            raise RunFolderError(
                f"{lost}: another launch may be writing {self.run_dir}; stopped before {before}, which was not "
                "written: make sure one run uses logging.run_dir, then continue with --resume"
            )

    def close(self) -> None:
        """Release the run folder's lock (rank 0; idempotent)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def start_actor(self, cfg: Config) -> MegatronActor:
        """The actor of `cfg` (collective), with the resumed checkpoint's state: it replaces `checkpoint.load`."""
        from megatron_rl.actor.actor import MegatronActor

        if self.resume_from is None:
            actor = MegatronActor(cfg)
        else:
            actor = MegatronActor(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=None)))
            try:
                actor.load(self.resume_from / ACTOR_DIR)
            except BaseException:
                actor.close()
                raise
        # What exists now (the imported modules, the model, the optimizer) lives as long as the process:
        # kept out of the garbage collector's scans, Megatron's gc.collect() at every checkpoint save
        # (its distributed optimizer's sharded state) walks only what the run made since, not millions
        # of objects (0.4 s a save on a CPU rank).
        gc.freeze()
        return actor

    def resume_model(self, model: CheckpointedModel, name: str, key: str) -> None:
        """Load `model` (collective) from the resumed checkpoint's folder `name` (`Stage.models`), when
        resuming; ConfigError naming `key` (the setting that asks for the model) when that checkpoint has none."""
        if self.resume_from is None:
            return
        folder = self.resume_from / name
        if not folder.is_dir():
            raise ConfigError(
                f"{key} = true, but the checkpoint {self.resume_from} holds no {name}/ (saved by a run without it): "
                f"resume with the settings it was saved with, or start afresh"
            )
        model.load(folder)

    def restore(self, stage: Stateful) -> None:
        """Give `stage` its named entries of the resumed checkpoint (`load_state_dict`); on rank 0 also
        restore the RNG state saved with them. Call it once the stage's pieces have started (the actor's
        start seeds the generators)."""
        if self.loop_state is None:
            return
        stage.load_state_dict(self.loop_state.entries)
        if self.rank == 0:
            restore_rng(self.loop_state.rng)

    def open_log(self, *, desc: str) -> MetricsLogger:
        """Rank 0 writes config.yaml and, when resuming, drops the records after `start_step` (all of
        them when there is no checkpoint to resume from); the step logger (every rank, writing on rank
        0, checking the lock before each record), which reports where the run resumes from."""
        cfg = self.cfg
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
            if self.resume_from is not None:
                truncate_metrics(self.run_dir, self.start_step)
        log = MetricsLogger(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.train.steps,
            start_step=self.start_step,
            tracking=cfg.logging,
            run_config=to_dict(cfg),
            progress=cfg.logging.progress,
            line_every=cfg.logging.every,
            append=self.resume_from is not None,
            desc=desc,
            guard=lambda step: self.check_lock(f"the record of step {step}"),
        )
        if self.resume:
            where = (
                f"from {self.resume_from} (step {self.start_step})"
                if self.resume_from
                else "from scratch: no checkpoint (--resume-if-any)"
            )
            if self.dropped_records:
                where += f", the {self.dropped_records} step records of a run stopped before it dropped"
            log.message(f"resuming {where} in {self.ckpt_root}")
        for old, new in self.moved_aside:
            log.message(f"--force: the previous run's {old} was moved to {new}")
        return log

    def save_checkpoint(
        self,
        actor: MegatronActor,
        step: int,
        entries: dict[str, Any],
        models: dict[str, CheckpointedModel] | None = None,
    ) -> Path:
        """CKPT_DIR/step_NNNNNN (collective): the actor and each of `models` into its folder (`Stage.models`:
        the critic), then rank 0's loop state and manifest into step_NNNNNN.tmp, renamed into place once every
        file is on disk; then pruning to `checkpoint.keep_last`. `entries`: the stage's named entries
        (`Stage.state_dict`; rank 0's are written); with a "rollout" entry the loop state records
        `rollout.async_mode` too."""
        staging = staging_dir(self.ckpt_root, step)
        self.check_lock(f"the checkpoint of step {step}")
        if self.rank == 0:
            remove_staging(self.ckpt_root)
        dist.barrier()
        written: dict[str, str] = {}
        try:
            for name, model in {ACTOR_DIR: actor, **(models or {})}.items():
                written.update({f"{name}/{file}": sha for file, sha in model.save(staging / name).items()})
        except (Exception, CheckpointException) as err:  # CheckpointException: a BaseException
            raise checkpoint_write_error(staging, err) from err
        shard_digests: list[dict[str, str]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(shard_digests, written)  # also: every rank's files are written before rank 0 lists them

        def finish() -> None:
            digests = {name: sha for per_rank in shard_digests for name, sha in per_rank.items()}
            state = LoopState(
                step=step,
                entries=entries,
                rollout_seed=self.cfg.train.seed,
                async_mode=self.cfg.rollout.async_mode if entries.get("rollout") is not None else None,
            )
            self.verified = commit_checkpoint(self.ckpt_root, state, digests)
            prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last, keep=self.verified)

        on_rank0(finish)
        return checkpoint_dir(self.ckpt_root, step)

    def export(self, actor: MegatronActor, out: Path) -> None:
        """The actor's policy as a Hugging Face folder at `out` (collective), replacing what is there."""
        self.check_lock(f"the export to {out}")
        from megatron_rl.models.export import save_hf_folder
        from megatron_rl.models.hf_io import prepare_output_dir
        from megatron_rl.models.lora import merged_weights
        from megatron_rl.models.source import assets_folder, hf_config_for_export

        if self.rank == 0:
            prepare_output_dir(out, force=True)
        dist.barrier()
        lora = getattr(actor, "lora", None)
        with merged_weights(lora) if lora is not None else contextlib.nullcontext():  # LoRA: the merged policy
            save_hf_folder(
                actor.chunks, self.cfg.model, out, hf_config_for_export(self.cfg), assets_from=assets_folder(self.cfg)
            )
        if lora is not None:  # and the adapters alone, as a PEFT folder on the base: RUN_DIR/hf_adapter
            from megatron_rl.actor.adapters import save_adapter_folder

            save_adapter_folder(actor, out.parent / "hf_adapter", self.cfg.model.hf_path)
