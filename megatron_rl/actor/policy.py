"""The policy model on this rank's share of the parallel layout, and the frozen reference built on it.

`Policy` is what the trainable actor (`actor.MegatronActor`) and the frozen reference
(`FrozenPolicy`) share: the model chunks built by `models.builder.build_model`, initialised from
the Hugging Face folder (converted in memory) or deterministically from `train.seed`, the routing
replay hooks, and the log-prob forward (`forward.compute_log_probs`, at the rollout temperature,
with routing recorded or replayed). The actor adds DDP, the optimizer and the schedule.

    reference = FrozenPolicy.start(cfg)             # after the actor: same layout, no optimizer state
    ref = reference.compute_log_probs(batch, replay_routing=True)   # R2/R3: the batch's routing

The reference is the run's starting policy: `model.hf_path` (+ `checkpoint.load`), or
`algorithm.ref_path` (a Hugging Face folder or a Megatron checkpoint). With `algorithm.ref_offload`
on a GPU its weights live in pinned host memory between uses: they never change, so offloading
only drops the device copies, and each use copies the weights to the device once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron_rl.actor.batch import ActorBatch
from megatron_rl.actor.checkpoint import rng_state, set_rng_state
from megatron_rl.actor.forward import LogProbResult, compute_log_probs
from megatron_rl.actor.micro_batches import TokenBudget
from megatron_rl.actor.routing_replay import RoutingReplay, check_routing_values
from megatron_rl.config import Config, ConfigError, ModelConfig
from megatron_rl.models.builder import build_model
from megatron_rl.models.checkpoint_io import load_model_weights
from megatron_rl.models.hf_config import model_config_from_hf, read_hf_config
from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
from megatron_rl.models.init import init_deterministic
from megatron_rl.parallel import ParallelContext, init_distributed
from megatron_rl.parallel.device import local_device

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


def check_architecture(model: ModelConfig, expected: ModelConfig, source: str) -> None:
    """ConfigError naming the `model.*` key whose value differs from `expected`, the architecture `source` describes."""
    pairs = [(name, getattr(model, name), getattr(expected, name)) for name in _HF_ARCHITECTURE_FIELDS]
    pairs.append(("kv_channels", _head_dim(model), _head_dim(expected)))
    if model.num_experts is None or model.first_k_dense_layers > 0:  # otherwise no layer has a dense MLP
        pairs.append(("ffn_hidden_size", model.ffn_hidden_size, expected.ffn_hidden_size))
    for name, have, want in pairs:
        if have != want:
            raise ConfigError(f"model.{name} = {have!r}, but {source} describes {want!r}")


def hf_initializer(model: ModelConfig, folder: str | None = None, key: str = "model.hf_path") -> Initializer:
    """Loads this rank's shard of every weight from the HF folder `folder` (default `model.hf_path`, read lazily).

    Raises ConfigError naming the `model.*` key whose value differs from the folder's config.json
    (`key` names the setting that gave the folder), and ConversionError for a checkpoint whose
    tensors do not fit (name and both shapes)."""
    folder = str(model.hf_path if folder is None else folder)
    source = f"{folder}/config.json ({key})"
    check_architecture(model, model_config_from_hf(read_hf_config(folder), source=source), source)
    checkpoint = open_hf_checkpoint(folder, model, source)

    def load(chunks: list[torch.nn.Module]) -> None:
        load_hf_weights(chunks, model, checkpoint)

    return load


def schedule_overrides(cfg: Config) -> dict[str, Any]:
    """The TransformerConfig keys the actor's schedule needs beyond the model's: packed micro-batches of other
    lengths exchanged between pipeline stages (`variable_seq_lengths`, which Megatron refuses with the
    allgather dispatcher: the actor then pads every micro-batch of a step to one shape)."""
    if cfg.parallel.pipeline_model_parallel_size > 1 and cfg.model.moe_token_dispatcher == "alltoall":
        return {"variable_seq_lengths": True}
    return {}


class Policy:
    """Model chunks of `cfg.model`, initialised, with routing replay and the whole-batch log-prob forward."""

    def __init__(self, cfg: Config, *, initializer: Initializer | None = None) -> None:
        """Join the parallel layout (`_join_layout`), build and initialise the model.

        `initializer(chunks)` sets the weights; default: the Hugging Face checkpoint `model.hf_path`
        (its config.json must describe `model`; checked before any process group exists), else
        layout-independent values from `train.seed` (`models.init.init_deterministic`).
        """
        self.cfg = cfg
        if initializer is None and cfg.model.hf_path:
            initializer = hf_initializer(cfg.model)
        self.context = self._join_layout()
        moe = cfg.model.num_experts is not None
        overrides = schedule_overrides(cfg)
        self.chunks = build_model(cfg.model, cfg.parallel, enable_routing_replay=moe, config_overrides=overrides)
        if initializer is None:
            init_deterministic(self.chunks, cfg.model, seed=cfg.train.seed)
        else:
            initializer(self.chunks)
        self.routing: RoutingReplay | None = RoutingReplay(self.chunks) if moe else None

    def _join_layout(self) -> ParallelContext | None:
        return init_distributed(self.cfg.parallel, self.cfg.model, seed=self.cfg.train.seed)

    def _forward_chunks(self) -> list[torch.nn.Module]:
        """The modules the schedule runs (the actor's DDP wrappers)."""
        return self.chunks

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
            self._forward_chunks(),
            batch,
            temperature=self.cfg.rollout.temperature,
            vocab_size=self.cfg.model.vocab_size,
            budget=TokenBudget.of(self.cfg.train),
            chunk_tokens=self.cfg.train.logprob_chunk_tokens,
            routing=self.routing,
            routing_mode=mode,
            updates=self.cfg.train.updates_per_step,
        )

    def close(self) -> None:
        """Detach the routing hooks (the parallel state stays for the caller to tear down)."""
        if self.routing is not None:
            self.routing.close()


def reference_config(cfg: Config) -> tuple[Config, str]:
    """The configuration the reference is built from, and the key that names its weights.

    The start policy (`model.hf_path`, then `checkpoint.load` when set), or `algorithm.ref_path`:
    a Hugging Face folder (it holds config.json) or a Megatron checkpoint (weights read, any kind)."""
    ref = cfg.algorithm.ref_path
    if ref is None:
        return cfg, "checkpoint.load" if cfg.checkpoint.load else "model.hf_path"
    if not Path(ref).is_dir():
        raise ConfigError(f"algorithm.ref_path = {ref!r} is not a folder (a Hugging Face folder or a checkpoint)")
    if (Path(ref) / "config.json").is_file():
        model, load = dataclasses.replace(cfg.model, hf_path=ref), None
    else:
        model, load = dataclasses.replace(cfg.model, hf_path=None), ref
    return dataclasses.replace(cfg, model=model, checkpoint=dataclasses.replace(cfg.checkpoint, load=load)), (
        "algorithm.ref_path"
    )


class FrozenPolicy(Policy):
    """The reference policy: built like the actor on the actor's running layout, frozen, no optimizer.

    Its log-probs are those the actor would compute with the same weights (the same forward, the
    same micro-batches); bf16/fp16 chunks run under Megatron's Float16Module as the actor's do.
    """

    def __init__(self, cfg: Config, *, offload: bool = False) -> None:
        """`cfg` as `reference_config` gives it; the actor's layout must be running (no new groups,
        no reseeding). `offload`: keep the weights in pinned host memory between uses (CUDA only)."""
        initializer = None
        if cfg.model.hf_path:
            initializer = hf_initializer(
                cfg.model, key="algorithm.ref_path" if cfg.algorithm.ref_path else "model.hf_path"
            )
        generators = rng_state()  # building draws from them: leave them as the actor set (or restored) them
        try:
            super().__init__(cfg, initializer=initializer)
            if cfg.checkpoint.load:
                load_model_weights(self.chunks, cfg.checkpoint.load)
        finally:
            set_rng_state(generators)
        for chunk in self.chunks:
            chunk.requires_grad_(False)
            chunk.eval()
        self._modules = list(self.chunks)
        config = self.chunks[0].config
        if config.bf16 or config.fp16:
            from megatron.core.transformer.module import Float16Module

            self._modules = [Float16Module(config, chunk) for chunk in self.chunks]
        self.offload = offload and torch.cuda.is_available()
        self._host: dict[int, torch.Tensor] = {}
        if self.offload:
            self._host = {id(t): t.detach().to("cpu").pin_memory() for t in self._tensors()}
            self._to_host()

    @classmethod
    def start(cls, cfg: Config) -> FrozenPolicy:
        """The reference of the run `cfg` (its start policy, or `algorithm.ref_path`); collective."""
        ref_cfg, _ = reference_config(cfg)
        return cls(ref_cfg, offload=cfg.algorithm.ref_offload)

    def _join_layout(self) -> ParallelContext | None:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            raise RuntimeError("FrozenPolicy joins the actor's parallel layout: start the actor first")
        return None

    def _forward_chunks(self) -> list[torch.nn.Module]:
        return self._modules

    def _tensors(self) -> list[torch.Tensor]:
        return [t for chunk in self.chunks for t in (*chunk.parameters(), *chunk.buffers())]

    def _to_host(self) -> None:
        for t in self._tensors():
            t.data = self._host[id(t)]
        torch.cuda.empty_cache()

    def _to_device(self) -> None:
        device = local_device()
        for t in self._tensors():
            t.data = self._host[id(t)].to(device, non_blocking=True)
        torch.cuda.synchronize()

    def on_device(self) -> bool:
        """Whether the weights are in device memory now (always, without offloading)."""
        return all(t.device == local_device() for t in self._tensors())

    def compute_log_probs(
        self, batch: ActorBatch, *, record_routing: bool = False, replay_routing: bool = False
    ) -> LogProbResult:
        """As `Policy.compute_log_probs`; with offloading the weights are on the device only during the call."""
        if not self.offload:
            return super().compute_log_probs(batch, record_routing=record_routing, replay_routing=replay_routing)
        self._to_device()
        try:
            return super().compute_log_probs(batch, record_routing=record_routing, replay_routing=replay_routing)
        finally:
            self._to_host()
