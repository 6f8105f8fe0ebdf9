"""The RL loop: `megatron-rl train CONFIG [key=value ...] [--resume]`, one process per trainer rank.

    torchrun --nproc-per-node 2 -m megatron_rl.cli train examples/tiny_math/rl.yaml parallel.expert_model_parallel_size=2
    megatron-rl train CONFIG                  # a single process runs as a world of one

Every rank holds a `Trainer`, the RL kind of `megatron_rl.stage.Stage` (the actor, the weight sync, the
run folder, the step log); rank 0 also holds the `RolloutRuntime` (`megatron_rl.loop.runtime`). Who runs
what, the start-up order (`Trainer.start`) and one step are described once, in docs/architecture.md.

RUN_DIR (`logging.run_dir`), its checkpoints and `--resume`: docs/checkpoints.md. On CPU a resumed run's
metrics equal the uninterrupted run's (timings aside) when the engine decodes one request at a time
(`rollout.max_concurrency=1`): batched decoding changes the engine's log-probs in the last bits.

Signals (`megatron_rl.parallel.signals`): SIGTERM and SIGUSR1 stop the run at the next step
boundary, agreed by every rank, with a checkpoint of that step (exit code 0 after SIGUSR1, 143 after
SIGTERM; rank 0's episodes still running `checkpoint.preempt_timeout_s` after the signal are aborted, so
the step ends); `--resume` continues from it. Ctrl-C (SIGINT), SIGHUP and the same stop signal twice stop at once
(Ctrl-C: exit code 130, one line, no traceback).
The engine child is stopped on every way out; if this process is killed outright, the engine's
parent-death signal ends it.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.batch_wire import WireBatch
from megatron_rl.config import Config, logprob_gap_limit, prompts_per_round, uses_reference, with_epoch_steps
from megatron_rl.loop.runtime import (
    ROLLOUT_ERRORS,
    RolloutData,
    RolloutRuntime,
    TrainPrompts,
    check_rollout_servers,
    spawn_engine_early,
)
from megatron_rl.loop.samples import StepBatch, step_advantages
from megatron_rl.losses.kl import kl_estimate
from megatron_rl.losses.value import value_batch_metrics, value_statistics
from megatron_rl.metrics import MetricsLogger, summarize_updates
from megatron_rl.models.source import hf_config_folder
from megatron_rl.parallel.device import local_device
from megatron_rl.parallel.rank0 import RankZeroError, on_rank0
from megatron_rl.parallel.signals import StopRequest
from megatron_rl.rewards import RewardFailureError
from megatron_rl.run_folder import CRITIC_DIR, CheckpointedModel, ResumeMode, RunFolder
from megatron_rl.stage import Stage

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.actor.adapters import AdaptersOffReference
    from megatron_rl.actor.policy import FrozenPolicy
    from megatron_rl.critic.critic import MegatronCritic
    from megatron_rl.weight_sync import WeightSync

T = TypeVar("T")
V = TypeVar("V")


class LogprobGapError(RuntimeError):
    """The engine's log-probs are too far from the trainer's: it serves other weights (`rollout.max_logprob_gap`)."""


# the run's own stops, raised on every rank (rank 0's reason reaches the others as RankZeroError): `train`
# ends them with one line from rank 0; any other error keeps its traceback
RUN_ERRORS: tuple[type[Exception], ...] = (LogprobGapError, RewardFailureError, RankZeroError, *ROLLOUT_ERRORS)


def on_rank0_with(held: V | None, call: Callable[[V], T]) -> T:
    """`call(held)` through `on_rank0` (collective), where `held` is what only rank 0 holds (None elsewhere)."""

    def on_holder() -> T:
        assert held is not None  # on_rank0 calls this on rank 0 only, which holds it
        return call(held)

    return on_rank0(on_holder)


def logprob_gap(
    trainer: list[torch.Tensor], rollout: list[torch.Tensor], masks: list[torch.Tensor]
) -> dict[str, float]:
    """How far the engine's log-probs are from the trainer's for the same tokens and weights, over
    each sample's loss tokens (`masks`; a trajectory's observation tokens have no engine log-prob):
    |difference| mean and max, and the k3 estimate of KL(pi_rollout || pi_trainer) per token."""
    diff = torch.cat([(t.double() - r.double())[m.bool()] for t, r, m in zip(trainer, rollout, masks, strict=True)])
    if diff.numel() == 0:
        return {}
    return {
        "logprob_gap/abs_mean": float(diff.abs().mean()),
        "logprob_gap/abs_max": float(diff.abs().max()),
        "logprob_gap/mean": float(diff.mean()),
        "logprob_gap/kl_k3": float((torch.expm1(diff) - diff).mean()),
    }


def reference_kl(
    log_probs: list[torch.Tensor],
    ref_log_probs: list[torch.Tensor],
    masks: list[torch.Tensor],
    estimator: str,
    max_log_ratio: float,
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per-token KL(pi || pi_ref) estimates (`algorithm.kl_estimator`) over each sample's loss tokens
    (float64 [r_i], 0 outside them), and `actor/kl_ref_mean` (per token) and `actor/kl_ref_max`."""
    per_token = [
        kl_estimate(lp.double(), ref.double(), m.bool(), estimator, max_log_ratio)
        for lp, ref, m in zip(log_probs, ref_log_probs, masks, strict=True)
    ]
    kept = torch.cat([k[m.bool()] for k, m in zip(per_token, masks, strict=True)])
    if kept.numel() == 0:
        return per_token, {}
    return per_token, {"actor/kl_ref_mean": float(kept.mean()), "actor/kl_ref_max": float(kept.max())}


def engine_model_path(cfg: Config, run_folder: RunFolder, actor: MegatronActor) -> str | None:
    """The folder the engine starts from: the policy's HF folder; for a local engine and a policy
    without one, RUN_DIR/hf_start, exported here (collective) before the engine starts."""
    if cfg.model.hf_path is None and cfg.rollout.uses_local_engine:
        out = run_folder.run_dir / "hf_start"
        run_folder.export(actor, out)
        return str(out)
    folder = hf_config_folder(cfg)  # SGLang servers: only read for the routed-experts layout
    return str(folder) if folder is not None else None


class Trainer(Stage):
    """The RL stage on one trainer rank: the actor, the weight sync, the run folder and the step log on
    every rank; `rank0`, the rollout runtime, on global rank 0 only (None on the other ranks)."""

    command = "train"
    evaluates_first = True

    def __init__(
        self,
        cfg: Config,
        run_folder: RunFolder,
        actor: MegatronActor,
        log: MetricsLogger,
        weight_sync: WeightSync,
        rank0: RolloutRuntime | None,
        reference: FrozenPolicy | AdaptersOffReference | None = None,
        critic: MegatronCritic | None = None,
    ) -> None:
        super().__init__(cfg, run_folder, actor, log)
        self.reference = reference
        self.critic = critic
        self.weight_sync = weight_sync
        self.rank0 = rank0
        self.version = 0  # the weight version the engine serves (a resumed run: its checkpoint's)
        self._held_rollout: bytes | None = None  # rank 0's rollout state while a checkpoint is written

    @classmethod
    def start(
        cls, cfg: Config, stack: contextlib.ExitStack, *, resume: ResumeMode = False, force: bool = False
    ) -> Trainer:
        """Start every piece in the order docs/architecture.md gives ("Start-up order"), collectively.
        `stack` closes each piece (the last started first), also when a later one fails to start. `cfg`
        is validated (`Stage.launch`)."""
        from megatron_rl.parallel import read_launch_env
        from megatron_rl.weight_sync import make_weight_sync
        from megatron_rl.weight_sync.memory import colocated_engines_released, release_colocated_engines

        rank = read_launch_env().rank
        prompts, epochs_line = None, ""
        if cfg.train.epochs:  # every rank reads the train files for the step count, before the run folder (resume)
            prompts = TrainPrompts.load(cfg)
            cfg, epochs_line = with_epoch_steps(cfg, prompts.count, prompts_per_round(cfg))
        run_folder = RunFolder(cfg, rank=rank, resume=resume, force=force, syncs_weights=True)
        stack.callback(run_folder.close)  # its lock, released last
        data = RolloutData.load(cfg, prompts) if rank == 0 else None  # bad data fails here, before the slow model start
        prompts = None  # the other ranks' copy, only counted
        if data is not None:
            stack.callback(data.close)  # the reward workers, also when a later piece fails to start
        if data is not None:  # SGLang servers answer and take the key; colocated ones free memory before the actor's
            check_rollout_servers(cfg, data.loop)
            release_colocated_engines(cfg, data.loop)
        engine_log = run_folder.run_dir / "engine.log"
        starting = spawn_engine_early(cfg, engine_log) if data is not None else None
        if starting is not None:
            stack.callback(starting.kill)  # a start-up that fails before the runtime takes the engine
        actor = run_folder.start_actor(cfg)
        stack.callback(actor.close)
        reference = None
        if uses_reference(cfg.algorithm):
            from megatron_rl.actor.adapters import start_reference

            # from `cfg`, not the resumed checkpoint: the reference is the start policy (or ref_path);
            # with LoRA, the actor with its adapters off
            reference = start_reference(cfg, actor)
            stack.callback(reference.close)
        critic = None
        if cfg.critic.enabled:
            from megatron_rl.critic.critic import MegatronCritic

            critic = MegatronCritic(cfg)  # after the actor: its layout
            stack.callback(critic.close)
            run_folder.resume_model(critic, CRITIC_DIR, "critic.enabled")
        log = run_folder.open_log(desc="rl")
        stack.callback(log.close)
        if epochs_line:
            log.message(epochs_line)
        model_path = engine_model_path(cfg, run_folder, actor)
        runtimes: list[RolloutRuntime] = []

        def start_runtime(data: RolloutData) -> None:
            runtime = RolloutRuntime(cfg, data, model_path=model_path, engine_log=engine_log, starting=starting)
            stack.callback(runtime.close)
            runtimes.append(runtime)

        on_rank0_with(data, start_runtime)
        rank0 = runtimes[0] if runtimes else None
        weight_sync = make_weight_sync(cfg, rank0.engine if rank0 is not None else None, actor)
        if rank0 is not None:  # a local engine restarted after its death gets the current weights
            rank0.engine.resync = weight_sync.resync_restarted_engine

        def close_weight_sync() -> None:
            with contextlib.suppress(Exception):  # the engine and the actor are closed after it in any case
                weight_sync.close()

        stack.callback(close_weight_sync)
        trainer = cls(cfg, run_folder, actor, log, weight_sync, rank0, reference, critic)
        run_folder.restore(trainer)
        if colocated_engines_released(cfg):
            weight_sync.mark_released()  # the engines need their weights back (a sync) before the first rollout
        if (
            run_folder.start_step > 0
            or cfg.checkpoint.load
            or colocated_engines_released(cfg)
            or cfg.model.lora.init_path
        ):
            trainer._sync(trainer.version)  # the engine serves model.hf_path: give it the checkpoint's weights
        return trainer

    # ---- what the stage's loop calls ----
    def models(self) -> dict[str, CheckpointedModel]:
        return {} if self.critic is None else {CRITIC_DIR: self.critic}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"weight_version": self.version}
        if self.rank0 is not None:
            state.update(sampler=self.rank0.data.sampler.state_dict(), rollout=self._held_rollout)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = state["weight_version"]
        if self.rank0 is not None:
            self.rank0.data.sampler.load_state_dict(state["sampler"])
            if state.get("rollout") is not None:
                self.rank0.load_state_dict(state["rollout"])

    @contextlib.contextmanager
    def holding_still(self) -> Iterator[None]:
        """Rank 0: the rollout side's state, in `state_dict`; no prompt is drawn while the checkpoint is written."""
        if self.rank0 is None:
            yield
            return
        with self.rank0.checkpoint_state() as self._held_rollout:
            try:
                yield
            finally:
                self._held_rollout = None

    def on_stop(self, stop_request: StopRequest) -> None:
        if self.rank0 is not None:  # a stop signal: the step ends within a bound
            rank0, grace = self.rank0, self.cfg.checkpoint.preempt_timeout_s
            stop_request.on_stop(lambda: rank0.abort_episodes_after(grace))

    def finish(self) -> None:
        if self.cfg.checkpoint.export_hf:
            hf_dir = self.run_folder.run_dir / "hf"
            self.run_folder.export(self.actor, hf_dir)
            self.log.message(f"final policy: {hf_dir}")

    def step(self, step: int) -> dict[str, Any]:
        began = time.perf_counter()
        version = self.version
        step_batch = self._collect(step, version)
        metrics: dict[str, Any] = {"step": step, **step_batch.metrics}
        if metrics.get("groups/target_missed"):
            self.log.message(
                f"step {step}: dynamic sampling kept {int(metrics['groups/groups_kept'])} informative groups of "
                f"{self.cfg.train.prompts_per_step} in {int(metrics['groups/rounds'])} rounds "
                "(algorithm.max_gen_rounds); training on what there is"
            )
        if step_batch.batch is None:
            metrics["actor/skipped"] = 1.0  # no informative group: nothing to learn from this step
        else:
            if self.cfg.rollout.colocate:
                self.weight_sync.release_engine_memory()
            metrics.update(self._update(step_batch, step))
            metrics["actor/skipped"] = 0.0
            trainable = getattr(self.actor, "trainable_params", None)  # an actor stand-in may not count them
            if trainable is not None:
                metrics["actor/trainable_params"] = float(trainable)
        # one_step_off: the next batch is finished before the weights change
        finished = on_rank0_with(self.rank0, lambda rank0: rank0.finish_step())
        metrics["time/wait_batch"] += finished["time/wait_batch"]
        metrics["time/engine_idle"] = finished["time/engine_idle"]
        if step_batch.batch is not None:
            metrics.update(self._sync(step))
            self.version = step
        metrics["time/step"] = time.perf_counter() - began
        if self.cfg.rollout.async_mode != "sync":
            self.log.message(
                f"step {step}: staleness mean {metrics['async/staleness_mean']:.2f} max "
                f"{metrics['async/staleness_max']:.0f}, dropped {metrics['async/dropped_stale']:.0f}, "
                f"buffer {metrics['async/buffer_groups']:.0f}, waited {metrics['time/wait_batch']:.2f} s"
            )
        return metrics

    def _collect(self, step: int, version: int) -> StepBatch:
        """Rank 0's batch of `step`, on every rank: its metrics from rank 0, the batch scattered as tensors
        (`actor.batch_scatter`: every rank the index, each DP rank its samples' routed experts). A local engine restarted during a `sync`-mode rollout
        that only a collective sync can give the current weights (distributed, tensor:
        `ResyncAtStepBoundary`) gets them here, from every rank at the step boundary, and the rollout
        is collected again (rollout.max_engine_restarts bounds the retries; the abandoned rollout's
        prompts are not drawn again). The asynchronous modes, whose generation runs on, stop instead."""
        from megatron_rl.actor.batch_scatter import scatter_batch
        from megatron_rl.weight_sync import ResyncAtStepBoundary, WeightSyncError

        mode = self.cfg.rollout.async_mode

        held: list[StepBatch] = []  # rank 0's whole batch, scattered below

        def collect(rank0: RolloutRuntime) -> tuple[dict[str, float], bool] | None:
            try:
                step_batch = rank0.collect(step, version)
                held[:] = [step_batch]
                return step_batch.metrics, step_batch.batch is not None
            except ResyncAtStepBoundary as err:
                if mode != "sync":
                    raise WeightSyncError(
                        f"{err}, and rollout.async_mode = {mode} generates on while the step would wait for it: "
                        "stopping (rollout.weight_sync=disk resends them from rank 0)"
                    ) from None
                self.log.message(f"step {step}: {err}: syncing from every rank, then collecting the step again")
                return None

        while (head := on_rank0_with(self.rank0, collect)) is None:
            self._sync(version)
        metrics, has_batch = head
        if not has_batch:
            return StepBatch(None, metrics)
        step_batch = held[0] if held else None
        sent = (
            WireBatch(step_batch.batch, step_batch.rewards, step_batch.versions, step_batch.episodes)
            if step_batch is not None
            else None
        )
        got, report = scatter_batch(
            sent, updates=self.cfg.train.updates_per_step, num_experts=self.cfg.model.num_experts
        )
        return StepBatch(got.batch, {**metrics, **report.metrics()}, got.rewards, got.versions, got.episodes)

    def _update(self, step_batch: StepBatch, step: int) -> dict[str, float]:
        """Old log-probs, reference log-probs, the critic's values, the advantages that wait for them, then
        `train.updates_per_step` updates of the critic and of the actor (none of the actor's during
        `critic.warmup_steps`), `train.ppo_epochs` times over (against those old log-probs); their metrics and
        timings.

        Old log-probs: recomputed (R2 records the routing; R3 replays the engine's) or the engine's.
        The reference runs under the same routing as the updates (R2's recorded, R3's engine routing)."""
        alg = self.cfg.algorithm
        batch = step_batch.batch
        assert batch is not None
        out: dict[str, float] = {}
        began = time.perf_counter()
        masks = [batch.loss_mask(i) for i in range(len(batch))]  # the tokens the loss, gap and KL see
        if alg.old_logprob_source == "recompute":
            r2, r3 = alg.routing_replay == "r2", alg.routing_replay == "r3"
            old = self.actor.compute_log_probs(batch, record_routing=r2, replay_routing=r3)
            routed = old.routed_experts if r2 else batch.routed_experts
            batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=routed)
            out.update(logprob_gap(old.log_probs, batch.rollout_log_probs, masks))
            # before the update: never train on another policy's rollouts. Only samples generated
            # wholly by the current weights can be compared (asynchronous modes also train older ones).
            fresh = [
                i
                for i in range(len(batch))
                if step_batch.versions is None or all(v == self.version for v in step_batch.versions[i])
            ]
            if fresh:
                self.check_logprob_gap(
                    logprob_gap(
                        [old.log_probs[i] for i in fresh],
                        [batch.rollout_log_probs[i] for i in fresh],
                        [masks[i] for i in fresh],
                    )
                )
        else:
            batch = batch.with_fields(old_log_probs=batch.rollout_log_probs)
        out["time/old_logprobs"] = time.perf_counter() - began
        kl = None
        if self.reference is not None:
            began = time.perf_counter()
            batch, kl = self._with_reference(batch, masks, out)
            out["time/ref_logprobs"] = time.perf_counter() - began
        if self.critic is not None:
            began = time.perf_counter()
            batch = batch.with_fields(old_values=self.critic.compute_values(batch))
            out["time/values"] = time.perf_counter() - began
        if batch.advantages is None:  # left to this point: the KL in the reward, or GAE of the critic's values
            if step_batch.rewards is None:
                raise ValueError("the step's batch came without its rewards, which its advantages need")
            advantages, returns, metrics = step_advantages(
                self.cfg, step_batch.rewards, masks, step_batch.episodes, kl, batch.old_values
            )
            batch = batch.with_fields(advantages=advantages, returns=returns)
            out.update(metrics)
        if self.critic is not None:
            out.update(self._train_critic(batch, masks))
        if step <= self.cfg.critic.warmup_steps:
            out["critic/warmup"] = 1.0  # the critic alone: the policy is not updated
            return out
        trained = time.perf_counter()
        history = self.actor.train(batch)
        done = time.perf_counter()
        out.update(summarize_updates(history))
        out["time/train"] = done - trained
        out["throughput/train_tokens_per_s"] = float(sum(batch.lengths)) / (done - trained) if done > trained else 0.0
        if not all(math.isfinite(h.get("loss", 0.0)) for h in history):
            raise FloatingPointError(f"the loss is not finite: {[h.get('loss') for h in history]} (lower train.lr?)")
        return out

    def _train_critic(self, batch: ActorBatch, masks: list[torch.Tensor]) -> dict[str, float]:
        """The critic's updates on `batch` (its V_old and returns) and their metrics, with the rollout batch's
        explained variance of the returns by V_old (`critic/vf_explained_var`)."""
        assert self.critic is not None and batch.old_values is not None and batch.returns is not None
        began = time.perf_counter()
        history = self.critic.train(batch)
        out = {**summarize_updates(history, prefix="critic/"), "time/critic_train": time.perf_counter() - began}
        rows = [torch.cat(part) for part in (batch.old_values, batch.returns, masks)]
        out.update(value_batch_metrics(value_statistics(*(r.view(1, -1) for r in rows))))
        if not all(math.isfinite(h["vf_loss"]) for h in history):
            raise FloatingPointError(
                f"the critic's loss is not finite: {[h['vf_loss'] for h in history]} (lower critic.lr?)"
            )
        return out

    def check_logprob_gap(self, gap: dict[str, float]) -> None:
        """Raise `LogprobGapError` on every rank when `logprob_gap/abs_mean` of the samples the current
        weights generated exceeds `rollout.max_logprob_gap`: the engine serves other weights than the actor's."""
        limit = logprob_gap_limit(self.cfg)
        if limit is None:
            return
        mean = torch.tensor([gap.get("logprob_gap/abs_mean", 0.0)], dtype=torch.float64, device=local_device())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.MAX)  # one decision for every rank
        if float(mean) <= limit:
            return
        rollout = self.cfg.rollout
        engine = (
            f"the SGLang server(s) {', '.join(rollout.sglang_urls)}"
            if not rollout.uses_local_engine
            else f"the local engine (log {self.run_folder.run_dir / 'engine.log'})"
        )
        raise LogprobGapError(
            f"the engine's log-probs differ from the trainer's by {float(mean):.4g} per token on average "
            f"(max {gap.get('logprob_gap/abs_max', float('nan')):.4g}) right after a weight sync, above "
            f"rollout.max_logprob_gap = {limit}: {engine} serves other weights than the trainer's (updated "
            "by another client, or a failed sync); stopping instead of training on its rollouts"
        )

    def _with_reference(
        self, batch: ActorBatch, masks: list[torch.Tensor], out: dict[str, float]
    ) -> tuple[ActorBatch, list[torch.Tensor]]:
        """`batch` with the reference's log-probs, and the per-token KL(pi_old || pi_ref) of every sample (the
        KL in the reward reads it); its metrics into `out`."""
        alg = self.cfg.algorithm
        assert self.reference is not None and batch.old_log_probs is not None
        ref = self.reference.compute_log_probs(batch, replay_routing=alg.routing_replay != "none")
        batch = batch.with_fields(ref_log_probs=ref.log_probs)
        kl, metrics = reference_kl(batch.old_log_probs, ref.log_probs, masks, alg.kl_estimator, alg.max_log_ratio)
        out.update(metrics)
        return batch, kl

    def _sync(self, step: int) -> dict[str, float]:
        report = self.weight_sync.sync(str(step))
        return {"time/sync": report.seconds, "weight_sync/bytes": float(report.bytes)}

    def evaluate(self, step: int) -> dict[str, float]:
        scores = on_rank0_with(self.rank0, lambda rank0: rank0.evaluate(step))
        if not scores:  # the episodes were aborted (a stop signal): no evaluation
            return scores
        shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k.startswith("eval/") and k != "eval/prompts")
        self.log.message(f"step {step}: {shown}")
        return scores


def run_training(cfg: Config, *, resume: ResumeMode = False, force: bool = False) -> dict[str, Any]:
    """`megatron-rl train` in this process (`Stage.launch`: validated, started, run, torn down)."""
    return Trainer.launch(cfg, resume=resume, force=force)
