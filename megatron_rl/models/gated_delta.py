"""Qwen3-Next's and Qwen3.5's layers on Megatron's local specs: Gated DeltaNet and the gated full attention.

`DeltaNet` is Megatron-Core's `GatedDeltaNet` (its parameters, their names and TP tags: `in_proj` = [q, k, v, z, b,
a] rows, the depthwise `conv1d` over [q, k, v], `A_log`, `dt_bias`, the gated `out_norm`, `out_proj`) with a forward
that runs without `fla`: the causal convolution and SiLU, q and k L2-normalised in fp32 (transformers' and fla's
`x * rsqrt(sum(x^2) + 1e-6)`), Megatron's pure-torch `torch_chunk_gated_delta_rule` (chunks of 64, fp32), the
RMSNorm of each value head gated by SiLU(z). Right-padded rows need nothing: the convolution and the recurrence are
causal. A packed (THD) micro-batch is cut at its `cu_seqlens` into right-padded rows first, so that the state and
the convolution's window start from zero at every sequence, as in a row of its own.

`qwen3_next_block_spec` turns the local specs' block into the family's: a `DeltaNet` in place of the attention of
every layer that is not every n-th, (1 + weight) RMSNorms around the layers, on q and k and at the end
(`gemma.GemmaRMSNorm`, transformers' `Qwen3NextRMSNorm`). The full attention's output gate is Megatron's own
(`attention_output_gate`: per query group [q heads, gate heads, k, v] rows of `linear_qkv`), the shared expert's
sigmoid gate too (`moe_shared_expert_gate`). Under TP a rank holds whole key heads with their value heads: its
share of every [q, k, v, z, b, a] section (`tp_row_sections`); context parallelism is refused (`attention_choice`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.ssm import gated_delta_net
from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules, torch_chunk_gated_delta_rule
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from torch import Tensor

from megatron_rl.config import ModelConfig
from megatron_rl.models.families import linear_attention_pattern
from megatron_rl.models.gemma import GemmaRMSNorm
from megatron_rl.models.norm import SequenceParallelRMSNorm


def linear_attention_fields(model: ModelConfig) -> dict[str, Any]:
    """TransformerConfig fields of a Qwen3-Next / Qwen3.5 model: the DeltaNet layers and their sizes, the gated
    full attention, the gated shared expert."""
    linear = model.linear_attention
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=linear_attention_pattern(model),
        linear_conv_kernel_dim=linear.conv_kernel,
        linear_key_head_dim=linear.key_head_dim,
        linear_value_head_dim=linear.value_head_dim,
        linear_num_key_heads=linear.num_key_heads,
        linear_num_value_heads=linear.num_value_heads,
        attention_output_gate=True,
        moe_shared_expert_gate=True,
    )


@contextlib.contextmanager
def _without_fla() -> Iterator[None]:
    """Megatron's `GatedDeltaNet.__init__` refuses to build without `fla`, whose kernels only its forward calls."""
    saved = gated_delta_net.HAVE_FLA
    gated_delta_net.HAVE_FLA = True
    try:
        yield
    finally:
        gated_delta_net.HAVE_FLA = saved


def l2_normalize(x: Tensor) -> Tensor:
    """x * rsqrt(sum(x^2) + 1e-6) over the last dimension, in fp32 (transformers' and fla's `l2norm`)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


class DeltaNet(GatedDeltaNet):
    """Megatron's Gated DeltaNet layer, its forward without `fla`, padded or packed (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with _without_fla():
            super().__init__(*args, **kwargs)

    def tp_row_sections(self, name: str) -> tuple[int, ...]:
        """The full sizes of the row sections that TP splits separately (`models.init.ParamShard.sections`):
        in_proj's [q, k, v, z, b, a] and conv1d's [q, k, v] channels; () for the rest."""
        if name == "in_proj.weight":
            heads = self.num_value_heads
            return (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, heads, heads)
        if name.startswith("conv1d."):
            return (self.qk_dim, self.qk_dim, self.v_dim)
        return ()

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None,
        *args: Any,
        packed_seq_params: PackedSeqParams | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        mixed, _ = self.in_proj(hidden_states)  # [s, b, d]: the whole sequence (gathered under SP), this rank's heads
        if packed_seq_params is None:
            out = self._mix(mixed.transpose(0, 1)).transpose(0, 1)
        else:
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            if bounds[0] != 0 or bounds[-1] != mixed.shape[0] or mixed.shape[1] != 1:
                raise ValueError(
                    f"DeltaNet: cu_seqlens {bounds} must start at 0 and end at the {mixed.shape[0]} tokens"
                )
            sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            rows = torch.nn.utils.rnn.pad_sequence(list(mixed[:, 0].split(sizes)), batch_first=True)
            mixed_rows = self._mix(rows)  # [sequences, longest, d]
            out = torch.cat([row[:n] for row, n in zip(mixed_rows, sizes, strict=True)])[:, None]
        return self.out_proj(out.contiguous())

    def _mix(self, mixed: Tensor) -> Tensor:
        """The token mixing of right-padded rows: in_proj's output [b, s, d] -> out_proj's input [b, s, v]."""
        batch, seq_len, _ = mixed.shape
        qk, v, heads = self.qk_dim // self.tp_size, self.v_dim // self.tp_size, self.num_v_heads_local_tp
        qkv, gate, beta, alpha = mixed.split([2 * qk + v, v, heads, heads], dim=-1)
        qkv = self.act_fn(self.conv1d(qkv.transpose(1, 2))[..., :seq_len]).transpose(1, 2)
        query, key, value = qkv.split([qk, qk, v], dim=-1)
        query = l2_normalize(query.reshape(batch, seq_len, -1, self.key_head_dim))
        key = l2_normalize(key.reshape(batch, seq_len, -1, self.key_head_dim))
        value = value.reshape(batch, seq_len, -1, self.value_head_dim)
        group = self.num_value_heads // self.num_key_heads
        query, key = query.repeat_interleave(group, dim=2), key.repeat_interleave(group, dim=2)
        g = -self.A_log.float().exp() * F.softplus(alpha.float() + self.dt_bias)
        core, _ = torch_chunk_gated_delta_rule(query, key, value.float(), g=g, beta=beta.float().sigmoid())
        normed = self.out_norm(core.reshape(-1, self.value_head_dim).to(mixed.dtype))
        gated = normed.float() * self.act_fn(gate.reshape(-1, self.value_head_dim).float())
        return gated.to(mixed.dtype).reshape(batch, seq_len, -1)


def delta_net_spec() -> ModuleSpec:
    """The local spec of a DeltaNet layer's token mixer."""
    return ModuleSpec(
        module=DeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=SequenceParallelRMSNorm, out_proj=RowParallelLinear
        ),
    )


def qwen3_next_block_spec(block: TransformerBlockSubmodules, config: Any) -> TransformerBlockSubmodules:
    """A copy of this pipeline stage's local-spec block with DeltaNet layers and (1 + weight) norms (see the
    module); the stage's first layer is global layer `get_transformer_layer_offset(config)`."""
    block = copy.deepcopy(block)
    offset = get_transformer_layer_offset(config)
    pattern = config.linear_attention_freq
    for i, layer in enumerate(block.layer_specs):
        sub = layer.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = GemmaRMSNorm
        if pattern[offset + i]:
            sub.self_attention = delta_net_spec()
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = GemmaRMSNorm
    return TransformerBlockSubmodules(layer_specs=block.layer_specs, layer_norm=GemmaRMSNorm)
