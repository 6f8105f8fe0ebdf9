"""A training stage's run folder (RL and SFT): config, metrics, checkpoints, exports, resume.

    RUN_DIR/config.yaml                               the resolved config
    RUN_DIR/metrics.jsonl                             the step records (`megatron_rl.metrics`)
    CKPT_DIR/step_NNNNNN/{actor/, loop_state.pt}      CKPT_DIR: checkpoint.dir, default RUN_DIR/checkpoints
    RUN_DIR/hf, RUN_DIR/hf_start                      the policy as a Hugging Face folder

The actor checkpoint (model, optimizer, schedule, per-rank RNG) is written first, collectively;
rank 0 then writes `loop_state.pt` (the step, the prompt sampler's position, rank 0's Python,
NumPy and torch RNG states, the rollout seed and the asynchronous rollout state) to a temporary name and renames it, so a folder
holding `loop_state.pt` is complete: a run killed while saving leaves a folder `latest_checkpoint`
skips; `checkpoint.keep_last` complete folders are kept. Rollout sampling needs no engine state:
every request's `sampling_seed` is derived from (train.seed, step, round, index)
(`megatron_rl.loop.collect.sampling_seed`). Resuming (`RunFolder(..., resume=True)`) continues from
the newest complete checkpoint and drops the records of later steps from metrics.jsonl; without
one the run starts from scratch. The frozen reference policy of a KL term is not saved: it is
the start policy (or `algorithm.ref_path`), rebuilt from the configuration on resume.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_rl.config import Config, to_yaml
from megatron_rl.metrics import MetricsLogger, truncate_metrics
from megatron_rl.parallel.rank0 import on_rank0

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.data import PromptSampler

logger = logging.getLogger(__name__)

LOOP_STATE_FILE = "loop_state.pt"
ACTOR_DIR = "actor"
_STEP_DIR = re.compile(r"^step_(\d+)$")
FORMAT_VERSION = 1


def checkpoint_dir(ckpt_root: str | Path, step: int) -> Path:
    return Path(ckpt_root) / f"step_{step:06d}"


def capture_rng() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU) generator states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


@dataclass
class LoopState:
    """What the loop itself needs to continue where a checkpoint was taken."""

    step: int
    sampler: dict[str, Any]
    rollout_seed: int
    rng: dict[str, Any] = field(default_factory=capture_rng)
    format_version: int = FORMAT_VERSION
    # the rollout side's state, pickled (`RolloutDriver.checkpoint_state`: one_step_off's pre-generated
    # batch, fully_async's buffer and prompts in flight); None in checkpoints written before it existed
    rollout: bytes | None = None


def save_loop_state(folder: str | Path, state: LoopState) -> Path:
    """Write `state` into the checkpoint `folder` atomically (rank 0 only); returns the file."""
    path = Path(folder) / LOOP_STATE_FILE
    tmp = path.with_name(path.name + ".tmp")
    torch.save(asdict(state), tmp)
    os.replace(tmp, path)
    return path


def load_loop_state(folder: str | Path) -> LoopState:
    path = Path(folder) / LOOP_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no loop state (not a complete megatron-rl train checkpoint)")
    data = torch.load(path, weights_only=False)  # our own file: Python/NumPy RNG tuples are not tensors
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: loop state format {data.get('format_version')}, this code reads {FORMAT_VERSION}")
    return LoopState(**data)


def checkpoints(ckpt_root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under `ckpt_root` as (step, folder), oldest first."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / LOOP_STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = checkpoints(ckpt_root)
    return found[-1][1] if found else None


def prune_checkpoints(ckpt_root: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest `keep_last` complete checkpoints, and incomplete folders older
    than the newest complete one; returns the removed folders."""
    root = Path(ckpt_root)
    complete = checkpoints(root)
    doomed = [path for _, path in complete[:-keep_last]] if keep_last > 0 else []
    if complete:
        newest = complete[-1][0]
        for child in root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and int(match.group(1)) < newest and not (child / LOOP_STATE_FILE).is_file():
                doomed.append(child)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class RunFolder:
    """One stage's run folder on every rank: where it resumes from, its logs, checkpoints and exports.

    Built before the actor: it finds the checkpoint to resume from and reads its loop state, so
    `start_step` is known from the start.
    """

    def __init__(self, cfg: Config, *, rank: int, resume: bool) -> None:
        self.cfg = cfg
        self.rank = rank
        self.resume = resume
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.resume_from = latest_checkpoint(self.ckpt_root) if resume else None
        self.loop_state = load_loop_state(self.resume_from) if self.resume_from is not None else None
        self.start_step = self.loop_state.step if self.loop_state is not None else 0
        if self.loop_state is not None and self.loop_state.rollout_seed != cfg.train.seed:
            logger.warning(
                "resuming with train.seed = %d, saved with %d: the rollouts will differ from the original run's",
                cfg.train.seed,
                self.loop_state.rollout_seed,
            )

    def start_actor(self, cfg: Config) -> MegatronActor:
        """The actor of `cfg` (collective), with the resumed checkpoint's state: it replaces `checkpoint.load`."""
        from megatron_rl.actor.actor import MegatronActor

        if self.resume_from is None:
            return MegatronActor(cfg)
        actor = MegatronActor(dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=None)))
        try:
            actor.load(self.resume_from / ACTOR_DIR)
        except BaseException:
            actor.close()
            raise
        return actor

    def restore_sampler(self, sampler: PromptSampler) -> None:
        """Put `sampler` where the resumed run's was; on rank 0 also restore the RNG state saved with it.

        Call it after the actor has started (its start seeds the generators)."""
        if self.loop_state is None:
            return
        sampler.load_state_dict(self.loop_state.sampler)
        if self.rank == 0:
            restore_rng(self.loop_state.rng)

    def open_log(self, *, desc: str) -> MetricsLogger:
        """Rank 0 writes config.yaml and, when resuming, drops the records after `start_step`; the
        step logger (every rank, writing on rank 0), which reports where the run resumes from."""
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
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            append=self.resume_from is not None,
            desc=desc,
        )
        if self.resume:
            where = (
                f"from {self.resume_from} (step {self.start_step})"
                if self.resume_from
                else "from scratch: no checkpoint"
            )
            log.message(f"resuming {where} in {self.ckpt_root}")
        return log

    def save_checkpoint(
        self, actor: MegatronActor, step: int, sampler: PromptSampler | None, rollout: bytes | None = None
    ) -> Path:
        """CKPT_DIR/step_NNNNNN (collective): the actor, then rank 0's loop state, then pruning to
        `checkpoint.keep_last`. `sampler` is the stage's prompt sampler, needed on rank 0; `rollout`
        rank 0's rollout state (`LoopState.rollout`)."""
        folder = checkpoint_dir(self.ckpt_root, step)
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)
        dist.barrier()
        actor.save(folder / ACTOR_DIR)

        def finish() -> None:
            if sampler is None:
                raise ValueError("save_checkpoint: rank 0 needs the prompt sampler (its position is loop state)")
            save_loop_state(
                folder,
                LoopState(step=step, sampler=sampler.state_dict(), rollout_seed=self.cfg.train.seed, rollout=rollout),
            )
            prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last)

        on_rank0(finish)
        return folder

    def export(self, actor: MegatronActor, out: Path) -> None:
        """The actor's policy as a Hugging Face folder at `out` (collective), replacing what is there."""
        from megatron_rl.models.export import save_hf_folder
        from megatron_rl.models.hf_io import prepare_output_dir
        from megatron_rl.models.source import assets_folder, hf_config_for_export

        if self.rank == 0:
            prepare_output_dir(out, force=True)
        dist.barrier()
        save_hf_folder(
            actor.chunks, self.cfg.model, out, hf_config_for_export(self.cfg), assets_from=assets_folder(self.cfg)
        )
