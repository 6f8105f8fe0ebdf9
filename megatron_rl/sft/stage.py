"""The SFT stage: cross-entropy on response tokens with the Megatron actor, then an HF folder.

    RUN_DIR/config.yaml               the resolved config
    RUN_DIR/metrics.jsonl             one JSON object per step: sft/ (loss, entropy_mean, grad_norm, lr,
                                      ...), time/, throughput/, and eval/ where evaluated (greedy
                                      accuracy, pass@n); TensorBoard events when installed
    RUN_DIR/checkpoints/step_NNNNNN   {actor/, loop_state.pt} every `checkpoint.every` steps and the last
                                      (`checkpoint.keep_last` kept; `megatron_rl.checkpoints`)
    RUN_DIR/hf                        the final policy as a Hugging Face folder: the RL stage's `model.hf_path`

The actor starts from `model.hf_path` (converted in memory; the architecture keys of `model` come
from its config.json, as in `megatron-rl train`) or `checkpoint.load`. Each step takes
`train.prompts_per_step` rows from `data.train_path` in a seeded order (`data.seed`, `data.shuffle`)
and makes `train.updates_per_step` optimizer steps on them; the learning-rate schedule spans all
`train.steps`. Log-probs are taken at temperature 1 whatever `rollout.temperature` says (that one
is the sampling temperature of pass@n). With `data.eval_path`, rank 0 serves the exported policy
with the local engine (or `rollout.sglang_urls`) and measures held-out accuracy every
`eval.every` steps and at the end. `--resume` continues from the newest complete checkpoint (the
actor, the row order's position), as `megatron-rl train --resume` does. SIGTERM and SIGUSR1 stop
after the current step with a checkpoint of it, as in `megatron-rl train` (`megatron_rl.parallel.signals`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.parallel.signals import StoppedBySignal, exit_code, stop_at_step_boundary
from megatron_rl.validation import validate_run

if TYPE_CHECKING:
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.run_folder import ResumeMode


class _Evaluator:
    """Rank 0's held-out evaluation: one engine serving RUN_DIR/hf, reloaded from disk after each export, on
    the rollout side's one event loop (`RolloutLoop`), where the evaluation's coroutines run."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        from megatron_rl.data import load_prompt_dataset
        from megatron_rl.rewards import RewardScorer
        from megatron_rl.rollout.event_loop import RolloutLoop

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.prompts = load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data)[: cfg.eval.max_prompts]
        self.loop = RolloutLoop()
        try:
            self.scorer = RewardScorer(cfg.reward, run=self.loop.run)
        except BaseException:
            self.loop.close()
            raise
        self.engine: RolloutEngine | None = None  # started at the first evaluation: RUN_DIR/hf exists from then on

    def __call__(self, hf_dir: Path, step: int) -> dict[str, float]:
        from megatron_rl.loop.runtime import collection_bound_s
        from megatron_rl.rollout.engine import RolloutEngine
        from megatron_rl.sft.evaluate import warm_start_scores

        if self.engine is None:
            self.engine = RolloutEngine.from_config(self.cfg.rollout, self.loop, model_path=str(hf_dir))
        else:
            self.engine.run(self.engine.client.update_weights_from_disk(str(hf_dir), weight_version=str(step)))
        scores = warm_start_scores(self.engine, self.prompts, self.tokenizer, self.scorer, self.cfg, step)
        return self.loop.run(scores, 2 * collection_bound_s(self.cfg, len(self.prompts)))  # greedy, then pass@n

    def close(self) -> None:
        try:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
        finally:
            try:
                self.scorer.close()  # the reward worker processes
            finally:
                self.loop.close()


def run_sft(cfg: Config, *, resume: ResumeMode = False, force: bool = False) -> dict[str, Any]:
    """Run the SFT stage of `cfg` in this process (one rank of a torchrun/srun launch); collective.
    With `resume`, continue from the newest complete checkpoint (refused without one; with
    `run_folder.RESUME_IF_ANY` a folder that holds no run starts from scratch); with `force`, a run
    folder that holds a run is moved aside (`run_folder.RunFolder`).

    Returns the last step's metrics and the paths written (every rank), and the last evaluation
    (rank 0, when `data.eval_path` is set)."""
    from megatron_rl.data import PromptSampler, load_tokenizer
    from megatron_rl.metrics import summarize_updates
    from megatron_rl.models.source import tokenizer_source
    from megatron_rl.parallel import destroy_distributed, read_launch_env
    from megatron_rl.run_folder import RunFolder
    from megatron_rl.sft.data import load_sft_examples, sft_batch
    from megatron_rl.sft.loss import cross_entropy_loss

    cfg = validate_run(cfg, "sft")
    rank = read_launch_env().rank
    run_folder = RunFolder(cfg, rank=rank, resume=resume, force=force)  # a run it would overwrite: refused first
    try:
        tokenizer = load_tokenizer(*tokenizer_source(cfg), vocab_size=cfg.model.vocab_size)
        examples, report = load_sft_examples(cfg.data.train_path, tokenizer, cfg.data)
        sampler = PromptSampler.from_config(examples, cfg.data)
    except BaseException:
        run_folder.close()
        raise
    hf_dir = run_folder.run_dir / "hf"
    result: dict[str, Any] = {"run_dir": str(run_folder.run_dir), "hf_dir": str(hf_dir)}
    start = time.perf_counter()
    stopped_by = 0
    with contextlib.ExitStack() as stack:
        stack.callback(run_folder.close)  # its lock, released last
        stop_request = stack.enter_context(stop_at_step_boundary())
        actor = run_folder.start_actor(
            dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=1.0))
        )
        stack.callback(destroy_distributed, process_group=False)
        stack.callback(actor.close)
        run_folder.restore_sampler(sampler)
        evaluator = _Evaluator(cfg, tokenizer) if rank == 0 and cfg.data.eval_path else None
        if evaluator is not None:
            stack.callback(evaluator.close)
        log = run_folder.open_log(desc="sft")
        stack.callback(log.close)
        log.message(f"sft: {report.summary()}")

        def evaluate(step: int, record: dict[str, Any]) -> None:
            run_folder.export(actor, hf_dir)  # the engine reads the policy from there
            if evaluator is not None:
                began = time.perf_counter()
                scores = evaluator(hf_dir, step)
                scores["time/eval"] = time.perf_counter() - began
                record.update(scores)
                shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "eval/prompts")
                log.message(f"sft step {step}: {shown}")
                result["eval"] = scores
            dist.barrier()

        record: dict[str, Any] = {}
        for step in range(run_folder.start_step + 1, cfg.train.steps + 1):
            batch = sft_batch(sampler.next(cfg.train.prompts_per_step))
            began = time.perf_counter()
            history = actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
            step_s = time.perf_counter() - began
            record = {"step": step, **summarize_updates(history, prefix="sft/")}
            if not math.isfinite(record["sft/loss"]):
                raise FloatingPointError(f"sft step {step}: the loss is {record['sft/loss']} (lower train.lr?)")
            record.update({"time/step": step_s, "throughput/samples_per_s": len(batch) / step_s})
            last = step == cfg.train.steps
            if last or (cfg.data.eval_path and cfg.eval.every and step % cfg.eval.every == 0):  # same on every rank
                evaluate(step, record)  # at the end also without evaluator: the final HF folder
            record["time/elapsed"] = time.perf_counter() - start
            log.log(record)  # logged before the checkpoint: resuming from step k keeps the records up to k
            stop = stop_request.agreed()  # SIGTERM/SIGUSR1 on any rank (megatron_rl.parallel.signals)
            if last or stop or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                result["checkpoint"] = str(run_folder.save_checkpoint(actor, step, sampler))
            if stop and not last:
                log.message(f"sft: {signal.Signals(stop).name}: stopped after step {step}; continue with --resume")
                stopped_by = stop
                break
        result["metrics"] = record
    if stopped_by:
        raise StoppedBySignal(exit_code(stopped_by))
    if rank == 0:
        print(f"sft: done in {time.perf_counter() - start:.0f} s; HF folder {hf_dir}", file=sys.stderr, flush=True)
    return result
