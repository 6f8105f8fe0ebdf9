"""`MegatronActor`: the policy on Megatron-Core, as the trainer uses it.

    actor = MegatronActor(cfg)                      # distributed init, model, DDP, optimizer, schedule
    old = actor.compute_log_probs(batch, record_routing=True)      # R2: also the routing
    batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    metrics = actor.train(batch)                    # one dict per optimizer step
    actor.save(path); actor.load(path)

Every rank passes the whole batch and gets whole-batch results back; a scattered step batch
(`batch_scatter`) holds routed experts for this DP rank's samples only, which is all its micro-batches read. Routing replay follows
`algorithm.routing_replay` unless the call says otherwise.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_rl.actor.adapters import attach_actor_lora, count_trainable
from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.actor.optimizer import build_training_state
from megatron_rl.actor.policy import Initializer, Policy, hf_initializer
from megatron_rl.actor.train_step import TokenLoss, train_on_batch
from megatron_rl.config import Config, loss_spec
from megatron_rl.models.init import gather_full_params
from megatron_rl.models.lora import LoraState
from megatron_rl.models.lora_checkpoint import base_record

__all__ = ["Initializer", "MegatronActor", "hf_initializer"]


class MegatronActor(Policy):
    """The policy model with its optimizer, on this process's share of the parallel layout."""

    def __init__(self, cfg: Config, *, initializer: Initializer | None = None) -> None:
        """Start (or join) the parallel layout of `cfg.parallel`, build and initialise the model.

        A layout that cannot run raises ConfigError naming the keys before any model exists; so does
        an `algorithm` section that is no valid loss spec (`self.loss_spec`, built here once).
        `initializer(chunks)` sets the weights; default: the Hugging Face checkpoint `model.hf_path`
        (converted in memory; its config.json must describe `model`), else layout-independent values
        from `train.seed` (`models.init.init_deterministic`). `checkpoint.load`, when set, is loaded after
        (a training checkpoint, or a weights-only one such as the converter's: see `checkpoint.load_checkpoint`).
        The model, its initialisation, routing replay and `compute_log_probs` are `policy.Policy`'s.
        """
        self.loss_spec = loss_spec(cfg.algorithm)
        super().__init__(cfg, initializer=initializer)
        # LoRA: the base frozen, the adapters the only parameters with gradients and optimizer state
        self.lora: LoraState | None = attach_actor_lora(self.chunks, cfg) if cfg.model.lora.rank > 0 else None
        self.state = build_training_state(self.chunks, cfg.train, cfg.parallel)
        self.trainable_params = count_trainable(self.lora, self.chunks, cfg)  # actor/trainable_params
        self.lora_base = base_record(cfg.model) if self.lora is not None else None  # what its checkpoints adapt
        if cfg.checkpoint.load:
            self.load(cfg.checkpoint.load)

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        return self.state.step

    def _forward_chunks(self) -> list[torch.nn.Module]:
        return self.state.model

    def _replay_default(self, replay: bool | None) -> bool:
        return self.cfg.algorithm.routing_replay != "none" if replay is None else replay

    def train(
        self, batch: ActorBatch, *, replay_routing: bool | None = None, loss: TokenLoss | None = None
    ) -> list[dict[str, float]]:
        """`train.updates_per_step` optimizer steps on `batch`, `train.ppo_epochs` times over; metrics per step,
        the same on every rank.

        `replay_routing`: None = `algorithm.routing_replay != 'none'`. `loss`: None = the policy loss
        of `algorithm` (see `train_step.train_on_batch`), else e.g. `megatron_rl.sft.cross_entropy_loss`.
        """
        replay = self._replay_default(replay_routing)
        self._validate(batch, replay)
        return train_on_batch(
            self.state,
            batch,
            self.loss_spec,
            updates=self.cfg.train.updates_per_step,
            epochs=self.cfg.train.ppo_epochs,
            budget=TokenBudget.of(self.cfg.train),
            chunk_tokens=self.cfg.train.logprob_chunk_tokens,
            temperature=self.cfg.rollout.temperature,
            vocab_size=self.cfg.model.vocab_size,
            token_norm=float(self.cfg.rollout.max_new_tokens),
            routing=self.routing,
            replay=replay,
            loss=loss,
            distill_coef=self.cfg.distill.kl_coef if batch.teacher_top_ids is not None else 0.0,
        )

    def save(self, path: str | os.PathLike) -> dict[str, str]:
        """Distributed checkpoint of model, optimizer, schedule, step and RNG (collective); returns the
        SHA-256 of each shard file this rank wrote, computed while writing (name in `path` -> hex)."""
        return save_checkpoint(self.state, path, lora=self.lora_base)

    def load(self, path: str | os.PathLike, *, load_optimizer: bool = True) -> dict[str, Any]:
        """Load a checkpoint saved under any layout (collective); see `checkpoint.load_checkpoint`."""
        return load_checkpoint(self.state, path, load_optimizer=load_optimizer, lora=self.lora_base)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every global parameter as a full fp32 CPU tensor on every rank (tests, small models)."""
        return gather_full_params(self.chunks, self.cfg.model)
