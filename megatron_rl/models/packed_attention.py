"""Megatron's local core attention, also for packed (THD) sequences: the local spec's attention module.

Megatron's `Attention` already handles the packed layout up to the core attention: with
`PackedSeqParams(qkv_format="thd", cu_seqlens_q=...)` it squeezes the batch dimension and applies
RoPE per sequence (positions restart at every `cu_seqlens` bound). Transformer Engine's core
attention then attends within each sequence; Megatron's local `DotProductAttention` refuses packed
input. `PackedDotProductAttention` runs the local one on each sequence of the pack in turn (each a
[n_i, 1, heads, dim] causal attention), which is the block-diagonal causal mask without building it:
the result of a sequence is that of the same sequence in a right-padded row.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor


class PackedDotProductAttention(DotProductAttention):
    """`DotProductAttention` that also takes THD input: q, k, v [t, heads, dim] with `packed_seq_params`."""

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        check_packed(packed_seq_params, attention_mask)
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        if bounds != packed_seq_params.cu_seqlens_kv.tolist() or bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(
                f"packed attention: cu_seqlens {bounds} must start at 0, end at the {query.shape[0]} tokens "
                "and be the same for queries and keys"
            )
        sizes = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        parts = [
            super(PackedDotProductAttention, self).forward(
                q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), None, attn_mask_type, attention_bias
            )
            for q, k, v in zip(query.split(sizes), key.split(sizes), value.split(sizes), strict=True)
        ]
        return torch.cat(parts, dim=0)  # [t, 1, heads x dim]


def check_packed(packed_seq_params: PackedSeqParams, attention_mask: Tensor | None) -> None:
    """ValueError unless the pack is THD and comes without a mask (its sequences' bounds are the mask)."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed attention needs qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
    if attention_mask is not None:
        raise ValueError("packed attention: the sequences' bounds are the mask; attention_mask must be None")
