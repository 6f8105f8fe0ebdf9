"""The RL loop: `megatron-rl train CONFIG [key=value ...] [--resume]`, one process per trainer rank.

    torchrun --nproc-per-node 2 -m megatron_rl.cli train examples/tiny_math/rl.yaml parallel.expert_model_parallel_size=2
    megatron-rl train CONFIG                  # a single process runs as a world of one

Who does what. Global rank 0 drives everything outside Megatron: it reads the prompts, starts the
local engine as a child process (when no `rollout.sglang_urls` are set) and talks to it, scores
the responses and builds the step's batch, then broadcasts that batch (or its error) to every
trainer rank. Generation happens once, so the ranks cannot each compute the batch themselves; the
batch is small next to the weights. Every rank then runs the actor's collectives on the whole batch
(old log-probs, `train.updates_per_step` updates) and the weight sync; evaluation is rank 0's again.

One step (see ../DESIGN.md): sample prompts -> generate `rollout.n_samples_per_prompt` per prompt
(seeded per request) -> reward, overlong shaping -> dynamic sampling (more rounds until the batch
holds `train.prompts_per_step` informative groups or `algorithm.max_gen_rounds`) -> group advantages
(`megatron_rl.loop.collect`) -> old log-probs: recomputed by the actor (`recompute`; with R2 the
routing is recorded and replayed) or the engine's (`rollout`; R3 replays the engine's routing) ->
updates -> weight sync -> evaluation every `eval.every` steps.

RUN_DIR (`logging.run_dir`): config.yaml, metrics.jsonl (+ tensorboard/ when installed),
engine.log, checkpoints/step_NNNNNN/{actor/, loop_state.pt} (every `checkpoint.every` steps and the
last; `checkpoint.keep_last` kept), weights/ (disk weight sync), hf/ (the final policy as a Hugging
Face folder). `--resume` continues from the newest complete checkpoint; on CPU the resumed run's
metrics equal the uninterrupted run's (timings aside) when the engine decodes one request at a time
(`rollout.max_concurrency=1`): batched decoding changes the engine's log-probs in the last bits.

The engine child is stopped on every way out: normal end, an error, Ctrl-C (SIGINT), SIGTERM and
SIGHUP (turned into exceptions here); if this process is killed outright, the engine's parent-death
signal ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.config import Config, to_yaml
from megatron_rl.loop.collect import RolloutCollector, StepBatch, check_loop_config, evaluate
from megatron_rl.loop.metrics import MetricsLogger, summarize_updates, truncate_metrics
from megatron_rl.loop.model_source import (
    assets_folder,
    hf_config_folder,
    hf_config_for_export,
    resolve_model,
    tokenizer_source,
)
from megatron_rl.loop.state import (
    ACTOR_DIR,
    LoopState,
    checkpoint_dir,
    latest_checkpoint,
    load_loop_state,
    prune_checkpoints,
    restore_rng,
    save_loop_state,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RankZeroError(RuntimeError):
    """A failure on rank 0 (rollout, reward, evaluation), raised on every rank with its message."""


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C so that the engine child is stopped."""


@contextlib.contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` (SIGINT already raises KeyboardInterrupt)."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated(128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def on_rank0(fn: Callable[[], T]) -> T:
    """`fn()` run on rank 0 and its result given to every rank (collective); if it raises, every
    rank raises (rank 0 its own exception, the others `RankZeroError` with its message)."""
    world = dist.get_world_size()
    if world == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as err:
            box[0] = ("error", f"{type(err).__name__}: {err}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RankZeroError(f"rank 0 failed: {value}")
    return value


def logprob_gap(trainer: list[torch.Tensor], rollout: list[torch.Tensor]) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's for the same tokens and weights:
    |difference| mean and max, and the k3 estimate of KL(pi_rollout || pi_trainer) per token."""
    diff = torch.cat([t.double() - r.double() for t, r in zip(trainer, rollout, strict=True)])
    if diff.numel() == 0:
        return {}
    return {
        "logprob_gap/abs_mean": float(diff.abs().mean()),
        "logprob_gap/abs_max": float(diff.abs().max()),
        "logprob_gap/mean": float(diff.mean()),
        "logprob_gap/kl_k3": float((torch.expm1(diff) - diff).mean()),
    }


def _data_metrics(prefix: str, report: Any) -> dict[str, float]:
    out = {f"data/{prefix}_rows_kept": float(report.kept), f"data/{prefix}_rows_skipped": float(len(report.skipped))}
    out.update({f"data/{prefix}_skipped_{reason}": float(n) for reason, n in report.counts.items()})
    return out


class Trainer:
    """The loop of one trainer rank: `setup()`, `run()`, and `close()` in any case (see `run_training`)."""

    def __init__(self, cfg: Config) -> None:
        from megatron_rl.parallel import read_launch_env

        check_loop_config(cfg)
        self.cfg = cfg = resolve_model(cfg)
        self.rank = read_launch_env().rank
        self.run_dir = Path(cfg.logging.run_dir)
        self.ckpt_root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.run_dir / "checkpoints"
        self.engine: Any = None
        self.weight_sync: Any = None
        self.actor: Any = None
        self.log = MetricsLogger(self.run_dir, enabled=False, total_steps=cfg.train.steps)
        self.start_step = 0
        self.data_metrics: dict[str, float] = {}

    def setup(self, *, resume: bool = False) -> None:
        """Data (rank 0), actor, checkpoint to resume from, logs, engine and weight sync (collective)."""
        cfg = self.cfg
        resume_from = latest_checkpoint(self.ckpt_root) if resume else None
        if self.rank == 0:
            self._load_data()  # bad data fails here, before the slow model start
        self._start_actor(resume_from)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
            if resume_from is not None:
                truncate_metrics(self.run_dir, self.start_step)
        self.log = MetricsLogger(
            self.run_dir,
            enabled=self.rank == 0,
            total_steps=cfg.train.steps,
            start_step=self.start_step,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            append=resume_from is not None,
        )
        if resume:
            where = f"from {resume_from} (step {self.start_step})" if resume_from else "from scratch: no checkpoint"
            self.log.message(f"resuming {where} in {self.ckpt_root}")
        self._start_engine()
        if self.start_step > 0 or cfg.checkpoint.load:
            self._sync(self.start_step)  # the engine serves model.hf_path: give it the checkpoint's weights

    # ---- start-up ----
    def _load_data(self) -> None:
        from megatron_rl.data import PromptSampler, load_prompt_dataset, load_tokenizer
        from megatron_rl.rewards import RewardScorer

        cfg = self.cfg
        self.tokenizer = load_tokenizer(*tokenizer_source(cfg))
        train = load_prompt_dataset(cfg.data.train_path, self.tokenizer, cfg.data)
        self.data_metrics = _data_metrics("train", train.report)
        self.eval_prompts = []
        if cfg.data.eval_path:
            held_out = load_prompt_dataset(cfg.data.eval_path, self.tokenizer, cfg.data)
            self.data_metrics.update(_data_metrics("eval", held_out.report))
            self.eval_prompts = list(held_out)[: cfg.eval.max_prompts]
        self.scorer = RewardScorer(cfg.reward)
        self.sampler = PromptSampler.from_config(train, cfg.data)
        self.collector = RolloutCollector(cfg, None, self.tokenizer, self.scorer, self.sampler)

    def _start_actor(self, resume_from: Path | None) -> None:
        from megatron_rl.actor.actor import MegatronActor

        cfg = self.cfg
        if resume_from is not None:  # the resumed checkpoint replaces checkpoint.load
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=None))
        self.actor = MegatronActor(cfg)
        if resume_from is None:
            return
        self.actor.load(resume_from / ACTOR_DIR)
        state = load_loop_state(resume_from)
        self.start_step = state.step
        if state.rollout_seed != cfg.train.seed:
            logger.warning(
                "resuming with train.seed = %d, saved with %d: the rollouts will differ from the original run's",
                cfg.train.seed,
                state.rollout_seed,
            )
        if self.rank == 0:
            self.sampler.load_state_dict(state.sampler)
            restore_rng(state.rng)

    def _start_engine(self) -> None:
        """Rank 0 starts (or connects to) the engine; a policy without an HF folder is exported first."""
        cfg = self.cfg
        local = cfg.rollout.engine == "local" or not cfg.rollout.sglang_urls
        folder = hf_config_folder(cfg)  # SGLang servers: only read for the routed-experts layout
        model_path = str(folder) if folder is not None else None
        if cfg.model.hf_path is None and local:
            model_path = str(self.run_dir / "hf_start")
            self._export(Path(model_path))

        def start() -> None:
            from megatron_rl.rollout.engine import RolloutEngine

            kwargs = {"log_path": str(self.run_dir / "engine.log")} if local else {}
            self.engine = RolloutEngine.from_config(cfg.rollout, model_path=model_path, **kwargs)
            self.collector.engine = self.engine

        on_rank0(start)
        from megatron_rl.weight_sync import make_weight_sync

        self.weight_sync = make_weight_sync(cfg, self.engine, self.actor)

    # ---- the loop ----
    def run(self) -> dict[str, Any]:
        """Train from `start_step` to `train.steps`; returns the last step's record (rank 0; {} elsewhere)."""
        cfg = self.cfg
        started = time.perf_counter()
        if cfg.eval.every and self.start_step == 0:
            self.log.log({"step": 0, **self._evaluate(0)}, advance=False)
        record: dict[str, Any] = {}
        checkpoint_s = None
        for step in range(self.start_step + 1, cfg.train.steps + 1):
            record = self._step(step)
            last = step == cfg.train.steps
            if cfg.eval.every and (step % cfg.eval.every == 0 or last):
                record.update(self._evaluate(step))
            if checkpoint_s is not None:
                record["time/checkpoint"], checkpoint_s = checkpoint_s, None
            record["time/elapsed"] = time.perf_counter() - started
            # logged before the checkpoint: resuming from step k keeps the records up to k
            self.log.log(record)
            if (cfg.checkpoint.every and step % cfg.checkpoint.every == 0) or last:
                began = time.perf_counter()
                self._checkpoint(step)
                checkpoint_s = time.perf_counter() - began
        if cfg.checkpoint.export_hf:
            self._export(self.run_dir / "hf")
            self.log.message(f"final policy: {self.run_dir / 'hf'}")
        return record if self.rank == 0 else {}

    def _step(self, step: int) -> dict[str, Any]:
        began = time.perf_counter()

        def collect() -> StepBatch:
            plan = self.collector.collect(step)
            plan.metrics.update(self.data_metrics)
            return plan

        plan = on_rank0(collect)
        metrics: dict[str, Any] = {"step": step, **plan.metrics}
        if metrics.get("groups/target_missed"):
            self.log.message(
                f"step {step}: dynamic sampling kept {int(metrics['groups/groups_kept'])} informative groups of "
                f"{self.cfg.train.prompts_per_step} in {int(metrics['groups/rounds'])} rounds "
                "(algorithm.max_gen_rounds); training on what there is"
            )
        if plan.batch is None:
            metrics["actor/skipped"] = 1.0  # no informative group: nothing to learn from this step
        else:
            if self.cfg.rollout.colocate:
                self.weight_sync.release_engine_memory()
            metrics.update(self._update(plan.batch))
            metrics["actor/skipped"] = 0.0
            metrics.update(self._sync(step))
        metrics["time/step"] = time.perf_counter() - began
        return metrics

    def _update(self, batch: Any) -> dict[str, float]:
        """Old log-probs, then `train.updates_per_step` updates; their metrics and timings."""
        alg = self.cfg.algorithm
        out: dict[str, float] = {}
        began = time.perf_counter()
        if alg.old_logprob_source == "recompute":
            r2 = alg.routing_replay == "r2"
            old = self.actor.compute_log_probs(batch, record_routing=r2)
            routed = old.routed_experts if r2 else batch.routed_experts
            batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=routed)
            out.update(logprob_gap(old.log_probs, batch.rollout_log_probs))
        else:
            batch = batch.with_fields(old_log_probs=batch.rollout_log_probs)
        trained = time.perf_counter()
        history = self.actor.train(batch)
        done = time.perf_counter()
        out.update(summarize_updates(history))
        tokens = float(sum(batch.lengths))
        out["time/old_logprobs"] = trained - began
        out["time/train"] = done - trained
        out["throughput/train_tokens_per_s"] = tokens / (done - trained) if done > trained else 0.0
        if not all(math.isfinite(h.get("loss", 0.0)) for h in history):
            raise FloatingPointError(f"the loss is not finite: {[h.get('loss') for h in history]} (lower train.lr?)")
        return out

    def _sync(self, step: int) -> dict[str, float]:
        report = self.weight_sync.sync(str(step))
        return {"time/sync": report.seconds, "weight_sync/bytes": float(report.bytes)}

    def _evaluate(self, step: int) -> dict[str, float]:
        def run_eval() -> dict[str, float]:
            began = time.perf_counter()
            scores = evaluate(self.engine, self.eval_prompts, self.tokenizer, self.scorer, self.cfg, step)
            scores["time/eval"] = time.perf_counter() - began
            return scores

        scores = on_rank0(run_eval)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k.startswith("eval/") and k != "eval/prompts")
        self.log.message(f"step {step}: {shown}")
        return scores

    # ---- checkpoints and export ----
    def _checkpoint(self, step: int) -> None:
        folder = checkpoint_dir(self.ckpt_root, step)
        if self.rank == 0 and folder.exists():
            shutil.rmtree(folder)
        dist.barrier()
        self.actor.save(folder / ACTOR_DIR)

        def finish() -> None:
            state = LoopState(step=step, sampler=self.sampler.state_dict(), rollout_seed=self.cfg.train.seed)
            save_loop_state(folder, state)
            prune_checkpoints(self.ckpt_root, self.cfg.checkpoint.keep_last)

        on_rank0(finish)

    def _export(self, out: Path) -> None:
        from megatron_rl.models.export import save_hf_folder
        from megatron_rl.models.hf_io import prepare_output_dir

        if self.rank == 0:
            prepare_output_dir(out, force=True)
        dist.barrier()
        save_hf_folder(
            self.actor.chunks, self.cfg.model, out, hf_config_for_export(self.cfg), assets_from=assets_folder(self.cfg)
        )

    def close(self) -> None:
        """Stop the engine child and the weight sync, close the logs, leave the process groups. Safe to repeat."""
        try:
            if self.weight_sync is not None:
                with contextlib.suppress(Exception):
                    self.weight_sync.close()
                self.weight_sync = None
        finally:
            try:
                if self.engine is not None:
                    engine, self.engine = self.engine, None
                    engine.close()
            finally:
                self.log.close()
                if self.actor is not None:
                    self.actor.close()
                    self.actor = None


def run_training(cfg: Config, *, resume: bool = False) -> dict[str, Any]:
    """Run `megatron-rl train` in this process (one rank of a torchrun/srun launch, or a world of one)."""
    from megatron_rl.parallel import destroy_distributed

    with signals_as_exceptions():
        trainer = None
        try:
            trainer = Trainer(cfg)
            trainer.setup(resume=resume)
            return trainer.run()
        finally:
            try:
                if trainer is not None:
                    trainer.close()
            finally:
                if dist.is_initialized():
                    destroy_distributed()
