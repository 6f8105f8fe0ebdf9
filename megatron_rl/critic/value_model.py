"""The critic's value model: the policy's backbone with a scalar value head in place of the LM output layer.

    chunks = build_value_model(cfg.model, cfg.parallel)   # after init_distributed, in the policy's layout
    value_initializer(cfg.model, seed, hf_path=cfg.critic.hf_path)(chunks)
    values = chunks[0](input_ids, position_ids, None)[..., 0]      # [B, T] on the last pipeline stage

The backbone is `models.builder.build_model`'s GPTModel (every family, TP/EP/PP/CP, packing), built untied
(the value model has no LM head to share the embedding with) and with its vocabulary output layer replaced,
on the last pipeline stage, by `ValueHead`: one [1, H] weight and a bias, the layout of transformers'
`*ForTokenClassification` with `num_labels = 1` (its `score`), which is verl's critic format.

The head is replicated over TP rather than split: a 1-wide output cannot be split over TP ranks, and the
head is H + 1 parameters. Without sequence parallelism every TP rank holds the whole hidden states and
computes the same values, with the same gradients. With sequence parallelism each TP rank applies the head
to its part of the sequence and the values (1 wide, not H) are gathered; the backward takes each rank's
part of the gradient (no reduction: every TP rank computes the same loss on the same values), and the head's
parameters carry Megatron's `sequence_parallel` mark, so `finalize_model_grads` sums their gradients over TP
as it does the norms'.

Initialisation (`value_initializer`): the backbone from the policy's Hugging Face folder (its lm_head not
read) and a fresh head drawn from the seed, N(0, 1/(H+1)^2) weights and a zero bias, so the first values are
near 0 (OpenRLHF's value-head initialisation); or backbone and head from `critic.hf_path`, a folder that
transformers' `AutoModelForTokenClassification.from_pretrained(folder, num_labels=1)` reads (and
`save_pretrained` writes); without either, the policy's deterministic weights (`models.init`) and the fresh head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.actor.policy import check_architecture
from megatron_rl.config import ModelConfig, ParallelConfig
from megatron_rl.models.builder import build_model
from megatron_rl.models.hf_config import ARCHITECTURES, ConversionError, model_config_from_hf, read_hf_config
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.import_hf import load_hf_weights, open_hf_checkpoint
from megatron_rl.models.init import ParamShard, init_deterministic, seeded_generator
from megatron_rl.parallel.device import local_device

HEAD = "output_layer"  # the GPTModel attribute (and parameter prefix) the value head takes
HF_HEAD = "score"  # transformers' token-classification head
_CAUSAL, _TOKEN = "ForCausalLM", "ForTokenClassification"

Initializer = Callable[[list[torch.nn.Module]], None]


class ValueHead(torch.nn.Module):
    """values = hidden @ weight.T + bias, [s, b, 1], in GPTModel's output-layer call (`weight` and
    `runtime_gather_output` are that call's arguments, unused: nothing is tied, nothing is split)."""

    def __init__(self, config: TransformerConfig, device: torch.device) -> None:
        super().__init__()
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
        self.sequence_parallel = config.sequence_parallel
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel  # gradients summed over TP (finalize_model_grads)

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, None]:
        values = F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)
        if self.sequence_parallel:
            values = gather_from_sequence_parallel_region(
                values, tensor_parallel_output_grad=False, group=ps.get_tensor_model_parallel_group()
            )
        return values, None


def value_model_config(model: ModelConfig) -> ModelConfig:
    """The `model` section the value model's chunks are built and named with: the policy's, untied."""
    return dataclasses.replace(model, tie_word_embeddings=False)


def build_value_model(
    model: ModelConfig, parallel: ParallelConfig, *, config_overrides: Mapping[str, Any] | None = None
) -> list[GPTModel]:
    """This rank's value-model chunks (after `init_distributed`, in `parallel`'s layout), free routing (no
    replay: the actor's routing is the policy's); the last stage's vocabulary output layer is built by
    GPTModel and dropped for the `ValueHead` (weights not yet set)."""
    chunks = build_model(value_model_config(model), parallel, config_overrides=config_overrides)
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer = ValueHead(chunk.config, local_device())
    return chunks


def is_head(shard: ParamShard) -> bool:
    return shard.local_name.startswith(f"{HEAD}.")


def _heads(chunks: list[torch.nn.Module]) -> list[ValueHead]:
    return [c.output_layer for c in chunks if getattr(c, "post_process", False)]


@torch.no_grad()
def init_value_head(chunks: list[torch.nn.Module], seed: int) -> None:
    """The fresh head: weights N(0, 1) / (H + 1) drawn from `seed` alone (every rank and layout the same), bias 0."""
    for head in _heads(chunks):
        hidden = head.weight.shape[1]
        values = torch.randn(head.weight.shape, generator=seeded_generator(seed, f"{HEAD}.weight")) / (hidden + 1)
        head.weight.copy_(values)
        head.bias.zero_()


def token_classification_head(folder: str, model: ModelConfig, key: str) -> dict[str, tuple[int, ...]]:
    """The shapes of a token-classification folder's head tensors (score.bias when `token_classification_bias`,
    transformers' default), once its config.json is checked: one `*ForTokenClassification` architecture of a
    supported family, describing `model` (errors naming `key`)."""
    source = f"{folder}/config.json ({key})"
    hf = read_hf_config(folder)
    archs = hf.get("architectures") or []
    causal = [a.removesuffix(_TOKEN) + _CAUSAL for a in archs if isinstance(a, str) and a.endswith(_TOKEN)]
    if len(archs) != 1 or len(causal) != 1 or causal[0] not in ARCHITECTURES:
        allowed = sorted(a.removesuffix(_CAUSAL) + _TOKEN for a in ARCHITECTURES)
        raise ConversionError(f"{source}: architectures = {archs!r}; a value model is one of {allowed}")
    check_architecture(model, model_config_from_hf({**hf, "architectures": causal}, source=source), source)
    head = {f"{HF_HEAD}.weight": (1, model.hidden_size)}
    if hf.get("token_classification_bias", True):
        head[f"{HF_HEAD}.bias"] = (1,)
    return head


@torch.no_grad()
def _load_head(chunks: list[torch.nn.Module], ckpt: HFCheckpoint) -> None:
    for head in _heads(chunks):
        head.weight.copy_(ckpt.read(f"{HF_HEAD}.weight"))
        if f"{HF_HEAD}.bias" in ckpt.shapes:
            head.bias.copy_(ckpt.read(f"{HF_HEAD}.bias"))
        else:
            head.bias.zero_()


def value_initializer(model: ModelConfig, seed: int, *, hf_path: str | None = None) -> Initializer:
    """Sets a value model's weights (`build_value_model`'s chunks): from the token-classification folder
    `hf_path` (`critic.hf_path`), else the policy's backbone (`model.hf_path`, or the deterministic weights
    of `seed`) and a fresh head from `seed`. The folders' headers are checked now, before any weight is read:
    ConfigError naming the key whose architecture differs, ConversionError for a tensor that does not fit."""
    built = value_model_config(model)
    if hf_path is not None:
        head = token_classification_head(hf_path, model, "critic.hf_path")
        ckpt = open_hf_checkpoint(hf_path, model, f"{hf_path}/config.json (critic.hf_path)", head=head)

        def from_critic_folder(chunks: list[torch.nn.Module]) -> None:
            load_hf_weights(chunks, built, ckpt, skip=is_head)
            _load_head(chunks, ckpt)

        return from_critic_folder
    if model.hf_path is not None:
        source = f"{model.hf_path}/config.json (model.hf_path)"
        check_architecture(model, model_config_from_hf(read_hf_config(model.hf_path), source=source), source)
        policy = open_hf_checkpoint(str(model.hf_path), model, source)

        def from_policy_folder(chunks: list[torch.nn.Module]) -> None:
            load_hf_weights(chunks, built, policy, skip=is_head)
            init_value_head(chunks, seed)

        return from_policy_folder

    def deterministic(chunks: list[torch.nn.Module]) -> None:
        init_deterministic(chunks, built, seed=seed)
        init_value_head(chunks, seed)

    return deterministic
