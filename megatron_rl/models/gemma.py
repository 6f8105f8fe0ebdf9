"""Gemma 2 and Gemma 3 (text) on Megatron's local layer specs: what their layer computes that Megatron-Core 0.16's
GPT layer does not, as transformers' `modeling_gemma2` / `modeling_gemma3` compute it.

- `GemmaRMSNorm`: x / rms(x) * (1 + weight) in fp32, cast back once at the end (the weight is stored
  zero-centred); every norm of the model: input, after the attention, before and after the MLP, the final one,
  and Gemma 3's per-head QK-norm.
- The sandwich norms: `GemmaSelfAttention` and `GemmaMLP` normalise their output (`post_layernorm`) before the
  residual add (transformers' post_attention_layernorm / post_feedforward_layernorm); the norms before them are
  the layer's input_layernorm and pre_mlp_layernorm (pre_feedforward_layernorm).
- Sliding-window layers: Megatron's `window_size` and `window_attn_skip_freq` (`builder.transformer_config`), which
  its local attention applies (keys q - window + 1 .. q); Gemma 3's sliding layers rotate with their own RoPE base
  (`rope_local_theta`, `GemmaSelfAttention.local_rope`), its full layers with the model's (linearly scaled
  positions with `rope_scaling = linear`).
- Gemma 2's attention soft-capping, c * tanh(s / c) on the scaled scores before the mask
  (`GemmaCoreAttention`); the final logit soft-capping on the output layer (`prepare_gemma`; the actor's
  chunked log-prob head reads `final_logit_softcapping`).
- Embeddings times sqrt(hidden_size), rounded to the model's dtype first (transformers' embed_scale).
- The tanh-approximated GELU of the GLU (`gelu_tanh`); softmax scale query_pre_attn_scalar ** -0.5.

Transformer Engine's fused layers are not used for these families (`attention_choice.transformer_engine_layers`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.utils import (
    is_layer_window_attention,
)
from torch import Tensor

from megatron_rl.config import ModelConfig
from megatron_rl.models.norm import norm_sharded_state_dict
from megatron_rl.models.packed_attention import PackedDotProductAttention

_SOFTCAP_ATTRIBUTE = "final_logit_softcapping"  # set on a Gemma GPTModel by `prepare_gemma`


def gelu_tanh(x: Tensor) -> Tensor:
    """transformers' gelu_pytorch_tanh."""
    return F.gelu(x, approximate="tanh")


def softcap(x: Tensor, cap: float) -> Tensor:
    """cap * tanh(x / cap), as transformers computes it."""
    return torch.tanh(x / cap) * cap


def gemma_fields(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig fields of a Gemma model: the tanh-GELU GLU and query_pre_attn_scalar's softmax scale (its
    sliding-window layers: `builder.transformer_config`)."""
    fields: dict[str, Any] = dict(activation_func=gelu_tanh)
    if model.query_pre_attn_scalar is not None:
        fields["softmax_scale"] = model.query_pre_attn_scalar**-0.5
    return fields


class GemmaRMSNorm(torch.nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in fp32, cast back to x's dtype. Its weight is tagged
    `sequence_parallel` for the reason `norm.SequenceParallelRMSNorm` gives."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **unused: Any) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = True

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The weight replicated over TP and DP, as Megatron's `sharded_state_dict_default` treats a module
        without this method: Megatron's MLP asks each of its children for it (`GemmaMLP.post_layernorm`)."""
        return norm_sharded_state_dict(self, prefix, sharded_offsets, metadata, tp_split={})


class GemmaSelfAttention(SelfAttention):
    """Megatron's self-attention whose output is normalised (`post_layernorm`, transformers'
    post_attention_layernorm); on a sliding-window layer with `rope_local_theta`, RoPE with that base."""

    def __init__(self, config: Any, *args: Any, rope_local_theta: float | None = None, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if config.add_bias_linear:
            raise ValueError("GemmaSelfAttention: Gemma's projections have no bias (add_bias_linear must be False)")
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.local_rope = None
        if sliding and rope_local_theta is not None:
            self.local_rope = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=1.0,
                rotary_base=rope_local_theta,
                use_cpu_initialization=config.use_cpu_initialization,
            )

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        emb = kwargs.get("rotary_pos_emb")
        if self.local_rope is not None and emb is not None:
            if not isinstance(emb, Tensor):
                raise ValueError("GemmaSelfAttention: expected one RoPE table from GPTModel (plain RoPE)")
            packed = kwargs.get("packed_seq_params")
            # the model's table covers positions 0 .. len - 1 (context parallelism is refused with windows)
            kwargs["rotary_pos_emb"] = self.local_rope(
                emb.shape[0], packed_seq=packed is not None and packed.qkv_format == "thd"
            )
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias


class GemmaMLP(MLP):
    """Megatron's MLP whose output is normalised (`post_layernorm`, transformers' post_feedforward_layernorm)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        output, bias = super().forward(hidden_states, *args, **kwargs)
        return self.post_layernorm(output), bias


class _SoftcappedSoftmax(torch.nn.Module):
    """Megatron's masked softmax of soft-capped scores."""

    def __init__(self, inner: torch.nn.Module, cap: float) -> None:
        super().__init__()
        self.inner, self.cap = inner, cap

    def forward(self, scores: Tensor, mask: Tensor | None, *args: Any) -> Tensor:
        return self.inner(softcap(scores, self.cap), mask, *args)


class GemmaCoreAttention(PackedDotProductAttention):
    """The local core attention (packed sequences too) with the scores soft-capped, `softcap` * tanh(s /
    `softcap`), after the softmax scale and before the mask, as Gemma 2's."""

    def __init__(self, *args: Any, softcap: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scale_mask_softmax = _SoftcappedSoftmax(self.scale_mask_softmax, softcap)


@dataclass
class _MLPSpec:
    """A ModuleSpec in all but its type, which `build_module` builds alike: Megatron's TransformerLayer logs a
    warning for every ModuleSpec MLP whose module is not MLP itself (it passes the TP group to MLP only), and
    `GemmaMLP` takes the default TP group, which is that group."""

    module: type
    submodules: Any
    params: dict[str, Any] = field(default_factory=dict)


def gemma_block_spec(block: TransformerBlockSubmodules, model: ModelConfig) -> TransformerBlockSubmodules:
    """A copy of the local specs' block with Gemma's norms, sandwich norms, sliding layers' RoPE and (Gemma 2)
    soft-capped core attention. The core attention is otherwise the one the local specs chose (windows and
    soft-capping refuse the others: `attention_choice.local_attention_only`)."""
    block = copy.deepcopy(block)
    for layer in block.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = GemmaRMSNorm
        attention = sub.self_attention
        attention.module = GemmaSelfAttention
        attention.params = {**attention.params, "rope_local_theta": model.rope_local_theta}
        if model.attn_logit_softcapping is not None:
            attention.submodules.core_attention = ModuleSpec(
                module=GemmaCoreAttention, params={"softcap": model.attn_logit_softcapping}
            )
        if model.qk_layernorm:
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = GemmaRMSNorm
        sub.mlp = _MLPSpec(GemmaMLP, sub.mlp.submodules)
    return TransformerBlockSubmodules(layer_specs=block.layer_specs, layer_norm=GemmaRMSNorm)


class _ScaleOutput:
    """A forward hook multiplying a module's output by a scalar in the output's dtype."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, module: torch.nn.Module, args: Any, output: Tensor) -> Tensor:
        return output * torch.tensor(self.factor).to(output.dtype)


class _SoftcapLogits:
    """A forward hook soft-capping the logits of an output layer (which returns (logits, bias))."""

    def __init__(self, cap: float) -> None:
        self.cap = cap

    def __call__(self, module: torch.nn.Module, args: Any, output: tuple[Tensor, Any]) -> tuple[Tensor, Any]:
        logits, bias = output
        return softcap(logits, self.cap), bias


def prepare_gemma(gpt: torch.nn.Module, model: ModelConfig) -> None:
    """After GPTModel is built: the embedding's output times sqrt(hidden_size), and the final logit
    soft-capping on the output layer's logits and for the actor's log-prob head (`final_logit_softcap`)."""
    if gpt.pre_process:
        gpt.embedding.register_forward_hook(_ScaleOutput(math.sqrt(model.hidden_size)))
    cap = model.final_logit_softcapping
    setattr(gpt, _SOFTCAP_ATTRIBUTE, cap)
    if gpt.post_process and cap is not None:
        gpt.output_layer.register_forward_hook(_SoftcapLogits(cap))


def final_logit_softcap(gpt: torch.nn.Module) -> float | None:
    """The soft-capping of `gpt`'s output logits (a Gemma model's final_logit_softcapping), None for none."""
    return getattr(gpt, _SOFTCAP_ATTRIBUTE, None)
