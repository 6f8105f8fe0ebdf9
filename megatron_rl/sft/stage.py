"""The SFT stage: cross-entropy on response tokens with the Megatron actor, then an HF folder.

    RUN_DIR/config.yaml               the resolved config
    RUN_DIR/metrics.jsonl             one JSON object per step: sft/ (loss, entropy_mean, grad_norm, lr,
                                      ...), time/, throughput/, and eval/ where evaluated (greedy
                                      accuracy, pass@n); TensorBoard events when installed
    RUN_DIR/checkpoints/step_NNNNNN   Megatron checkpoints (every `checkpoint.every` steps and the last)
    RUN_DIR/hf                        the final policy as a Hugging Face folder: the RL stage's `model.hf_path`

The actor starts from `model.hf_path` (converted in memory; the architecture keys of `model` come
from its config.json, as in `megatron-rl train`) or `checkpoint.load`. Each step takes
`train.prompts_per_step` rows from `data.train_path` in a seeded order (`data.seed`, `data.shuffle`)
and makes `train.updates_per_step` optimizer steps on them; the learning-rate schedule spans all
`train.steps`. Log-probs are taken at temperature 1 whatever `rollout.temperature` says (that one
is the sampling temperature of pass@n). With `data.eval_path`, rank 0 serves the exported policy
with the local engine (or `rollout.sglang_urls`) and measures held-out accuracy every
`eval.every` steps and at the end.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_rl.config import Config, to_yaml
from megatron_rl.validation import validate_run


class _Evaluator:
    """Rank 0's held-out evaluation: one engine serving RUN_DIR/hf, reloaded from disk after each export."""

    def __init__(self, cfg: Config, tokenizer: Any) -> None:
        from megatron_rl.data import load_prompt_dataset
        from megatron_rl.rewards import RewardScorer

        self.cfg = cfg
        self.tokenizer = tokenizer
        self.prompts = load_prompt_dataset(cfg.data.eval_path, tokenizer, cfg.data)[: cfg.eval.max_prompts]
        self.scorer = RewardScorer(cfg.reward)
        self.engine: Any = None

    def __call__(self, hf_dir: Path, step: int) -> dict[str, float]:
        from megatron_rl.rollout.engine import RolloutEngine
        from megatron_rl.sft.evaluate import warm_start_scores

        if self.engine is None:
            self.engine = RolloutEngine.from_config(self.cfg.rollout, model_path=str(hf_dir))
        else:
            self.engine.run(self.engine.client.update_weights_from_disk(str(hf_dir), weight_version=str(step)))
        return warm_start_scores(self.engine, self.prompts, self.tokenizer, self.scorer, self.cfg, step)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _save_checkpoint(actor: Any, folder: Path, step: int, keep_last: int) -> Path:
    from megatron_rl.loop.state import checkpoint_dir

    path = checkpoint_dir(folder, step)
    if dist.get_rank() == 0 and path.exists():
        shutil.rmtree(path)
    dist.barrier()
    actor.save(path)
    if dist.get_rank() == 0:
        for old in sorted(folder.glob("step_*"))[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def _export(actor: Any, cfg: Config, out: Path) -> None:
    from megatron_rl.loop.model_source import assets_folder, hf_config_for_export
    from megatron_rl.models.export import save_hf_folder
    from megatron_rl.models.hf_io import prepare_output_dir

    if dist.get_rank() == 0:
        prepare_output_dir(out, force=True)
    dist.barrier()
    save_hf_folder(actor.chunks, cfg.model, out, hf_config_for_export(cfg), assets_from=assets_folder(cfg))


def run_sft(cfg: Config) -> dict[str, Any]:
    """Run the SFT stage of `cfg` in this process (one rank of a torchrun/srun launch); collective.

    Returns the last step's metrics and the paths written (every rank), and the last evaluation
    (rank 0, when `data.eval_path` is set)."""
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.data import PromptSampler, load_tokenizer
    from megatron_rl.loop.metrics import MetricsLogger, summarize_updates
    from megatron_rl.loop.model_source import tokenizer_source
    from megatron_rl.parallel import destroy_distributed
    from megatron_rl.sft.data import load_sft_examples, sft_batch
    from megatron_rl.sft.loss import cross_entropy_loss

    cfg = validate_run(cfg, "sft")
    tokenizer = load_tokenizer(*tokenizer_source(cfg))
    examples, report = load_sft_examples(cfg.data.train_path, tokenizer, cfg.data)
    sampler = PromptSampler.from_config(examples, cfg.data)
    run_dir = Path(cfg.logging.run_dir)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    hf_dir = run_dir / "hf"
    actor_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, temperature=1.0))
    actor = MegatronActor(actor_cfg)
    rank0 = dist.get_rank() == 0
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    evaluator = _Evaluator(cfg, tokenizer) if rank0 and cfg.data.eval_path else None
    log = MetricsLogger(
        run_dir,
        enabled=rank0,
        total_steps=cfg.train.steps,
        tensorboard=cfg.logging.tensorboard,
        progress=cfg.logging.progress,
        desc="sft",
    )
    log.message(f"sft: {report.summary()}")
    result: dict[str, Any] = {"run_dir": str(run_dir), "hf_dir": str(hf_dir)}
    start = time.perf_counter()

    def evaluate(step: int, record: dict[str, Any]) -> None:
        _export(actor, cfg, hf_dir)  # the engine reads the policy from there
        if evaluator is not None:
            began = time.perf_counter()
            scores = evaluator(hf_dir, step)
            scores["time/eval"] = time.perf_counter() - began
            record.update(scores)
            shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "eval/prompts")
            log.message(f"sft step {step}: {shown}")
            result["eval"] = scores
        dist.barrier()

    try:
        record: dict[str, Any] = {}
        for step in range(1, cfg.train.steps + 1):
            batch = sft_batch(sampler.next(cfg.train.prompts_per_step))
            began = time.perf_counter()
            history = actor.train(batch, loss=cross_entropy_loss, replay_routing=False)
            step_s = time.perf_counter() - began
            record = {"step": step, **summarize_updates(history, prefix="sft/")}
            if not math.isfinite(record["sft/loss"]):
                raise FloatingPointError(f"sft step {step}: the loss is {record['sft/loss']} (lower train.lr?)")
            record.update({"time/step": step_s, "throughput/samples_per_s": len(batch) / step_s})
            last = step == cfg.train.steps
            if last or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0):
                result["checkpoint"] = str(_save_checkpoint(actor, ckpt_dir, step, cfg.checkpoint.keep_last))
            if last or (cfg.data.eval_path and cfg.eval.every and step % cfg.eval.every == 0):  # same on every rank
                evaluate(step, record)  # at the end also without evaluator: the final HF folder
            record["time/elapsed"] = time.perf_counter() - start
            log.log(record)
        result["metrics"] = record
    finally:
        log.close()
        if evaluator is not None:
            evaluator.close()
        actor.close()
        destroy_distributed(process_group=False)
    if rank0:
        print(f"sft: done in {time.perf_counter() - start:.0f} s; HF folder {hf_dir}", file=sys.stderr, flush=True)
    return result
