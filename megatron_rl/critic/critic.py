"""`MegatronCritic`: PPO's value model as the trainer uses it, colocated on the trainer ranks in the actor's layout.

    critic = MegatronCritic(cfg)                    # after the actor: its layout, its own model, optimizer, schedule
    values = critic.compute_values(batch)           # V_old: float32 [r_i] per sample, on every rank (no grad)
    batch = batch.with_fields(old_values=values, returns=returns)     # the returns: GAE's (loop/samples.py)
    metrics = critic.train(batch)                   # one dict per optimizer step, the same on every rank
    critic.save(path); critic.load(path)

The value model (`value_model.py`) runs through the actor's machinery, so the same layout rules hold:
TP (with sequence parallelism), EP, PP (1F1B), CP and DP, right-padded or packed micro-batches
(`train.micro_batch_tokens`), the step's samples split over the DP ranks as the actor splits them. A value
V(s_t) is read at the position whose hidden state predicts response token t (the log-probs' target
positions: verl's `values[:, -response_length - 1 : -1]`). Routing is free (the actor's R2/R3 replay is the
policy's routing).

The optimizer and schedule are the actor's (`actor.optimizer`: Megatron's Adam, `train.*` betas, weight
decay, gradient clip, warm-up and decay over `train.steps x train.updates_per_step` updates) at `critic.lr`,
its floor `train.min_lr` scaled alike (critic.lr x train.min_lr / train.lr). Each step trains
`train.updates_per_step` mini-batches of the clipped value loss (`losses.value`, `critic.cliprange_value`),
token-mean over each mini-batch's response tokens. Checkpoints: the actor's format (`actor.checkpoint`: model,
optimizer, schedule; loadable under any layout).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model
from torch import Tensor

from megatron_rl.actor.batch import ActorBatch, MicroBatchInputs
from megatron_rl.actor.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from megatron_rl.actor.forward import (
    is_output_owner,
    plan_for_rank,
    prepare_inputs,
    run_schedule,
    share_response_values,
)
from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.actor.optimizer import build_training_state
from megatron_rl.actor.policy import schedule_overrides
from megatron_rl.actor.train_step import train_on_batch
from megatron_rl.config import Config, TrainConfig, loss_spec
from megatron_rl.critic.value_model import build_value_model, value_initializer
from megatron_rl.losses import Normalizer
from megatron_rl.losses.value import value_loss, value_update_metrics


def critic_train_config(cfg: Config) -> TrainConfig:
    """The `train` section the critic's optimizer and schedule are built from: the actor's at `critic.lr`."""
    train = cfg.train
    min_lr = cfg.critic.lr * train.min_lr / train.lr if train.lr > 0 else 0.0
    return dataclasses.replace(train, lr=cfg.critic.lr, min_lr=min_lr)


def value_head(model: torch.nn.Module, hidden: Tensor, mb: MicroBatchInputs) -> Tensor:
    """The last stage's values of a micro-batch, float32 [rows, positions] in the row layout (0 outside the
    target mask when packed): the `ValueHead` on the final hidden states (gathered over TP under sequence
    parallelism, then over CP by `to_rows`)."""
    values, _ = unwrap_model(model).output_layer(hidden)  # [s, b, 1]
    return mb.to_rows(values[..., 0].t().float())


class MegatronCritic:
    """The value model of `cfg` with its optimizer, on this process's share of the actor's layout."""

    def __init__(self, cfg: Config) -> None:
        """Build and initialise the value model (`value_model.value_initializer`: `critic.hf_path`, else the
        policy's backbone and a fresh head from `train.seed`) in the running layout, leaving the random
        generators as the actor set (or restored) them; then DDP, the optimizer and the schedule."""
        if not ps.model_parallel_is_initialized():
            raise RuntimeError("MegatronCritic joins the actor's parallel layout: start the actor first")
        self.cfg = cfg
        initialize = value_initializer(cfg.model, cfg.train.seed, hf_path=cfg.critic.hf_path)
        generators = rng_state()
        try:
            self.chunks = build_value_model(cfg.model, cfg.parallel, config_overrides=schedule_overrides(cfg))
            initialize(self.chunks)
        finally:
            set_rng_state(generators)
        self.state = build_training_state(self.chunks, critic_train_config(cfg), cfg.parallel)
        self._spec = loss_spec(cfg.algorithm)  # the mini-batch split only: the value loss replaces the policy's

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        return self.state.step

    def compute_values(self, batch: ActorBatch) -> list[Tensor]:
        """V(s_t) of every response token, float32 [r_i] per sample, on every rank (no grad); the step's
        split over the DP ranks (`train.updates_per_step`) as the actor's log-probs."""
        budget = TokenBudget.of(self.cfg.train)
        micro_batches = plan_for_rank(batch.lengths, budget, self.cfg.train.updates_per_step)
        model = self.state.model
        inputs = prepare_inputs(model, batch, micro_batches, every_response_token=True)

        def keep(mb: MicroBatchInputs, values: Tensor) -> tuple[Tensor, Any]:
            return values.new_zeros(()), mb.response_rows(values)

        for chunk in model:
            chunk.eval()
        try:
            with torch.no_grad():
                result = run_schedule(model, inputs, keep, head=value_head, forward_only=True)
        finally:
            for chunk in model:
                chunk.train()
        owned: dict[int, Tensor] = {}
        if is_output_owner():
            for mb, rows in zip(inputs, result.extras, strict=True):
                owned.update(zip(mb.micro_batch.indices, rows, strict=True))
        return share_response_values(batch, owned)

    def train(self, batch: ActorBatch) -> list[dict[str, float]]:
        """`train.updates_per_step` optimizer steps, `train.ppo_epochs` times over, of the clipped value loss on `batch`, which needs
        `old_values` and `returns`; metrics per step (`vf_loss`, `vf_clipfrac`, `vpred_mean`, `grad_norm`,
        `lr`, ...), the same on every rank."""
        for name in ("old_values", "returns"):
            if getattr(batch, name) is None:
                raise ValueError(f"critic.train: ActorBatch.{name} is required")
        clip = self.cfg.critic.cliprange_value

        def loss(values: Tensor, f: dict[str, Tensor], mask: Tensor, norm: Normalizer) -> tuple[Tensor, Any]:
            return value_loss(values, f["old_values"], f["returns"], mask, clip, num_tokens=norm.num_tokens)

        train = self.cfg.train
        return train_on_batch(
            self.state,
            batch,
            self._spec,
            updates=train.updates_per_step,
            epochs=train.ppo_epochs,  # verl's critic takes the actor's ppo_epochs
            budget=TokenBudget.of(train),
            chunk_tokens=train.logprob_chunk_tokens,
            temperature=self.cfg.rollout.temperature,
            vocab_size=self.cfg.model.vocab_size,
            token_norm=float(self.cfg.rollout.max_new_tokens),
            loss=loss,
            head=value_head,
            finalize=value_update_metrics,
        )

    def save(self, path: str | os.PathLike) -> dict[str, str]:
        """Distributed checkpoint of model, optimizer, schedule and step (collective); the SHA-256 of each
        shard file this rank wrote (name in `path` -> hex)."""
        return save_checkpoint(self.state, path)

    def load(self, path: str | os.PathLike) -> dict[str, Any]:
        """Load a critic checkpoint saved under any layout (collective); see `actor.checkpoint.load_checkpoint`."""
        return load_checkpoint(self.state, path)

    def close(self) -> None:
        """Nothing to detach (no routing hooks); the parallel state is the actor's."""
