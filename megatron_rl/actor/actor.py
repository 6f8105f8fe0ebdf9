"""`MegatronActor`: the policy on Megatron-Core, as the trainer uses it.

    actor = MegatronActor(cfg)                      # distributed init, model, DDP, optimizer, schedule
    old = actor.compute_log_probs(batch, record_routing=True)      # R2: also the routing
    batch = batch.with_fields(old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    metrics = actor.train(batch)                    # one dict per optimizer step
    actor.save(path); actor.load(path)

Every rank passes the whole batch and gets whole-batch results back. Routing replay follows
`algorithm.routing_replay` unless the call says otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.checkpoint import load_checkpoint, save_checkpoint
from megatron_rl.actor.forward import LogProbResult, compute_log_probs
from megatron_rl.actor.optimizer import build_training_state
from megatron_rl.actor.routing_replay import RoutingReplay, check_routing_values
from megatron_rl.actor.train_step import TokenLoss, train_on_batch
from megatron_rl.config import Config, ConfigError, ModelConfig, loss_spec
from megatron_rl.models.builder import build_model
from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
from megatron_rl.models.init import gather_full_params, init_deterministic
from megatron_rl.parallel import ParallelContext, init_distributed

Initializer = Callable[[list[torch.nn.Module]], None]

# ModelConfig fields that a Hugging Face config.json determines (the rest are training choices).
_HF_ARCHITECTURE_FIELDS = (
    "family",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "rope_theta",
    "norm_epsilon",
    "qk_layernorm",
    "add_qkv_bias",
    "tie_word_embeddings",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_router_norm_topk",
    "moe_layer_freq",
    "first_k_dense_layers",
)


def _head_dim(model: ModelConfig) -> int:
    return model.kv_channels or model.hidden_size // model.num_attention_heads


def hf_initializer(model: ModelConfig) -> Initializer:
    """Loads this rank's shard of every weight from the HF folder `model.hf_path` (read lazily).

    Raises ConfigError naming the `model.*` key whose value differs from the folder's config.json,
    and ConversionError for a checkpoint whose tensors do not fit (name and both shapes)."""
    folder = str(model.hf_path)
    source = f"{folder}/config.json (model.hf_path)"
    expected = model_config_from_hf(read_hf_config(folder), source=source)
    pairs = [(name, getattr(model, name), getattr(expected, name)) for name in _HF_ARCHITECTURE_FIELDS]
    pairs.append(("kv_channels", _head_dim(model), _head_dim(expected)))
    if model.num_experts is None or model.first_k_dense_layers > 0:  # otherwise no layer has a dense MLP
        pairs.append(("ffn_hidden_size", model.ffn_hidden_size, expected.ffn_hidden_size))
    for name, have, want in pairs:
        if have != want:
            raise ConfigError(f"model.{name} = {have!r}, but {source} describes {want!r}")
    checkpoint = open_hf_checkpoint(folder, model, source)

    def load(chunks: list[torch.nn.Module]) -> None:
        load_hf_weights(chunks, model, checkpoint)

    return load


class MegatronActor:
    """The policy model with its optimizer, on this process's share of the parallel layout."""

    def __init__(self, cfg: Config, *, initializer: Initializer | None = None) -> None:
        """Start (or join) the parallel layout of `cfg.parallel`, build and initialise the model.

        A layout that cannot run raises ConfigError naming the keys before any model exists; so does
        an `algorithm` section that is no valid loss spec (`self.loss_spec`, built here once).
        `initializer(chunks)` sets the weights; default: the Hugging Face checkpoint `model.hf_path`
        (converted in memory; its config.json must describe `model`), else layout-independent values
        from `train.seed` (`models.init.init_deterministic`). `checkpoint.load`, when set, is loaded after
        (a training checkpoint, or a weights-only one such as the converter's: see `checkpoint.load_checkpoint`).
        """
        self.cfg = cfg
        self.loss_spec = loss_spec(cfg.algorithm)
        if initializer is None and cfg.model.hf_path:
            initializer = hf_initializer(cfg.model)  # checks config.json before any process group exists
        self.context: ParallelContext = init_distributed(cfg.parallel, cfg.model, seed=cfg.train.seed)
        moe = cfg.model.num_experts is not None
        overrides: dict[str, Any] = {}
        if cfg.parallel.pipeline_model_parallel_size > 1 and cfg.model.moe_token_dispatcher == "alltoall":
            overrides["variable_seq_lengths"] = True  # Megatron refuses it with the allgather dispatcher
        self.chunks = build_model(cfg.model, cfg.parallel, enable_routing_replay=moe, config_overrides=overrides)
        if initializer is None:
            init_deterministic(self.chunks, cfg.model, seed=cfg.train.seed)
        else:
            initializer(self.chunks)
        self.routing: RoutingReplay | None = RoutingReplay(self.chunks) if moe else None
        self.state = build_training_state(self.chunks, cfg.train, cfg.parallel)
        if cfg.checkpoint.load:
            self.load(cfg.checkpoint.load)

    @property
    def step(self) -> int:
        """Optimizer steps taken (restored by `load`)."""
        return self.state.step

    def _validate(self, batch: ActorBatch, replay: bool) -> None:
        model = self.cfg.model
        batch.validate(
            vocab_size=model.vocab_size,
            num_layers=model.num_layers,
            top_k=model.moe_router_topk,
            num_experts=model.num_experts,
        )
        if replay:
            if self.routing is None:
                raise ValueError("routing replay needs an MoE model (model.num_experts)")
            if batch.routed_experts is None:
                raise ValueError("routing replay needs ActorBatch.routed_experts (R2: record them; R3: the engine's)")
            check_routing_values(batch.routed_experts, self.routing.layers, model.num_experts)

    def _replay_default(self, replay: bool | None) -> bool:
        return self.cfg.algorithm.routing_replay != "none" if replay is None else replay

    def compute_log_probs(
        self, batch: ActorBatch, *, record_routing: bool = False, replay_routing: bool = False
    ) -> LogProbResult:
        """Log-probs and entropy (float32 [r_i] per sample) of every response token, at the rollout
        temperature; `record_routing` also returns the routing (SGLang layout), `replay_routing`
        uses `batch.routed_experts`."""
        if record_routing and replay_routing:
            raise ValueError("compute_log_probs: record_routing and replay_routing exclude each other")
        if record_routing and self.routing is None:
            raise ValueError("record_routing needs an MoE model (model.num_experts)")
        self._validate(batch, replay_routing)
        mode = "record" if record_routing else "replay" if replay_routing else None
        return compute_log_probs(
            self.state.model,
            batch,
            temperature=self.cfg.rollout.temperature,
            vocab_size=self.cfg.model.vocab_size,
            max_tokens=self.cfg.train.max_tokens_per_micro_batch,
            chunk_tokens=self.cfg.train.logprob_chunk_tokens,
            routing=self.routing,
            routing_mode=mode,
        )

    def train(
        self, batch: ActorBatch, *, replay_routing: bool | None = None, loss: TokenLoss | None = None
    ) -> list[dict[str, float]]:
        """`train.updates_per_step` optimizer steps on `batch`; metrics per step, the same on every rank.

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
            max_tokens=self.cfg.train.max_tokens_per_micro_batch,
            chunk_tokens=self.cfg.train.logprob_chunk_tokens,
            temperature=self.cfg.rollout.temperature,
            vocab_size=self.cfg.model.vocab_size,
            token_norm=float(self.cfg.rollout.max_new_tokens),
            routing=self.routing,
            replay=replay,
            loss=loss,
        )

    def save(self, path: str | os.PathLike) -> None:
        """Distributed checkpoint of model, optimizer, schedule, step and RNG (collective)."""
        save_checkpoint(self.state, path)

    def load(self, path: str | os.PathLike, *, load_optimizer: bool = True) -> dict[str, Any]:
        """Load a checkpoint saved under any layout (collective); see `checkpoint.load_checkpoint`."""
        return load_checkpoint(self.state, path, load_optimizer=load_optimizer)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every global parameter as a full fp32 CPU tensor on every rank (tests, small models)."""
        return gather_full_params(self.chunks, self.cfg.model)

    def close(self) -> None:
        """Detach the routing hooks (the parallel state stays for the caller to tear down)."""
        if self.routing is not None:
            self.routing.close()
