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
and makes `train.updates_per_step` optimizer steps on them (`train.ppo_epochs` passes over them); the
learning-rate schedule spans all `train.steps` (with `train.epochs`: derived from the usable rows,
`megatron_rl.config.epochs`; `data/epoch` in each record counts the passes over them). Log-probs are taken at temperature 1 whatever `rollout.temperature` says (that one
is the sampling temperature of pass@n). With `data.eval_path`, rank 0 serves the exported policy
with the local engine (or `rollout.sglang_urls`) and measures held-out accuracy every
`eval.every` steps and at the end. `--resume` continues from the newest complete checkpoint (the
actor, the row order's position), as `megatron-rl train --resume` does. SIGTERM and SIGUSR1 stop
after the current step with a checkpoint of it, as in `megatron-rl train` (`megatron_rl.parallel.signals`).
Its start-up and loop are `megatron_rl.stage.Stage`'s, as the RL loop's are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from megatron_rl.config import Config
from megatron_rl.stage import Stage

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.data import PromptSampler
    from megatron_rl.metrics import MetricsLogger
    from megatron_rl.parallel.signals import StopRequest
    from megatron_rl.rollout.engine import RolloutEngine
    from megatron_rl.run_folder import ResumeMode, RunFolder


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


class SFTStage(Stage):
    """The SFT stage on one rank: the actor trained on the sampler's rows; rank 0's evaluator, when
    `data.eval_path` is set (None elsewhere)."""

    command = "sft"
    log_prefix = "sft: "

    def __init__(
        self,
        cfg: Config,
        run_folder: RunFolder,
        actor: MegatronActor,
        log: MetricsLogger,
        sampler: PromptSampler,
        evaluator: _Evaluator | None,
    ) -> None:
        super().__init__(cfg, run_folder, actor, log)
        self.sampler = sampler
        self.evaluator = evaluator
        self.hf_dir = run_folder.run_dir / "hf"
        self.started = time.perf_counter()

    @classmethod
    def start(cls, cfg: Config, stack: contextlib.ExitStack, *, resume: ResumeMode, force: bool) -> SFTStage:
        """The run folder (a run it would overwrite: refused first), the examples (bad data fails before
        the slow actor start; with `train.epochs` they come first, for the step count), the actor, rank 0's
        evaluator, the step log; `stack` closes each. `cfg` is validated (`Stage.launch`)."""
        from megatron_rl.config import with_epoch_steps
        from megatron_rl.data import PromptSampler, load_tokenizer
        from megatron_rl.models.source import tokenizer_source
        from megatron_rl.parallel import read_launch_env
        from megatron_rl.run_folder import RunFolder
        from megatron_rl.sft.data import load_sft_examples

        def read(cfg: Config) -> tuple[Any, list[Any], Any]:
            tokenizer = load_tokenizer(*tokenizer_source(cfg), vocab_size=cfg.model.vocab_size)
            return tokenizer, *load_sft_examples(cfg.data.train_path, tokenizer, cfg.data)

        rank = read_launch_env().rank
        loaded, epochs_line = None, ""
        if cfg.train.epochs:  # the step count comes from the examples, before the run folder (resume)
            loaded = read(cfg)
            cfg, epochs_line = with_epoch_steps(cfg, len(loaded[1]), cfg.train.prompts_per_step)
        run_folder = RunFolder(cfg, rank=rank, resume=resume, force=force)
        stack.callback(run_folder.close)  # its lock, released last
        tokenizer, examples, report = loaded if loaded is not None else read(cfg)
        sampler = PromptSampler.from_config(examples, cfg.data)
        # log-probs at temperature 1: rollout.temperature is pass@n's sampling temperature
        actor = run_folder.start_actor(
            dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=1.0))
        )
        stack.callback(actor.close)
        evaluator = _Evaluator(cfg, tokenizer) if rank == 0 and cfg.data.eval_path else None
        if evaluator is not None:
            stack.callback(evaluator.close)
        log = run_folder.open_log(desc="sft")
        stack.callback(log.close)
        log.message(f"sft: {report.summary()}")
        if epochs_line:
            log.message(f"sft: {epochs_line}")
        stage = cls(cfg, run_folder, actor, log, sampler, evaluator)
        run_folder.restore(stage)
        return stage

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def step(self, step: int) -> dict[str, Any]:
        from megatron_rl.metrics import summarize_updates
        from megatron_rl.sft.data import sft_batch
        from megatron_rl.sft.loss import cross_entropy_loss

        batch = sft_batch(self.sampler.next(self.cfg.train.prompts_per_step))
        began = time.perf_counter()
        history = self.actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
        step_s = time.perf_counter() - began
        record = {"step": step, **summarize_updates(history, prefix="sft/"), "data/epoch": self.sampler.epochs_drawn}
        if not math.isfinite(record["sft/loss"]):
            raise FloatingPointError(f"sft step {step}: the loss is {record['sft/loss']} (lower train.lr?)")
        return {**record, "time/step": step_s, "throughput/samples_per_s": len(batch) / step_s}

    def eval_due(self, step: int) -> bool:
        # the last step always exports RUN_DIR/hf (the RL stage's start), evaluated with data.eval_path
        return step == self.cfg.train.steps or (bool(self.cfg.data.eval_path) and super().eval_due(step))

    def evaluate(self, step: int) -> dict[str, float]:
        """RUN_DIR/hf exported (collective), then rank 0's held-out scores of it (with `time/eval`)."""
        self.run_folder.export(self.actor, self.hf_dir)  # the engine reads the policy from there
        scores: dict[str, float] = {}
        if self.evaluator is not None:
            began = time.perf_counter()
            scores = self.evaluator(self.hf_dir, step)
            scores["time/eval"] = time.perf_counter() - began
            shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "eval/prompts")
            self.log.message(f"sft step {step}: {shown}")
        dist.barrier()
        return scores

    def on_stop(self, stop_request: StopRequest) -> None:
        """Nothing: a step is the actor's update alone, which ends by itself."""

    def finish(self) -> None:
        if self.run_folder.rank == 0:
            done = f"sft: done in {time.perf_counter() - self.started:.0f} s; HF folder {self.hf_dir}"
            print(done, file=sys.stderr, flush=True)


def run_sft(cfg: Config, *, resume: ResumeMode = False, force: bool = False) -> dict[str, Any]:
    """`megatron-rl sft` in this process (`Stage.launch`: validated, started, run, torn down); the last
    step's record."""
    return SFTStage.launch(cfg, resume=resume, force=force)
