"""The local specs' core attention under context parallelism (CP > 1 without Transformer Engine).

A CP rank holds its positions of every sequence (`parallel.context_parallel`: Megatron's
load-balanced chunks r and 2 x CP - 1 - r; a packed micro-batch split sequence by sequence over the
padded `cu_seqlens`). Its queries need the keys and values of every earlier position of their
sequence, wherever they lie, so the keys and values are all-gathered over the CP group and put back
in order (`gather_for_attention`: its backward sums their gradients over the group and keeps this
rank's positions), and the causal mask comes from the positions: the query at position p of its
sequence sees the keys at positions <= p. Megatron's local `DotProductAttention` computes the
attention with that mask: one call for right-padded rows, one per sequence of a pack (the
block-diagonal mask without building it), so every query's result is the one it has without CP.
Multi-latent attention's widths (keys of `k_channels`, values of `v_channels`) are taken as
`MLADotProductAttention` takes them. Each rank holds [its queries, the whole sequence] of scores:
CP splits the queries, not the keys. Transformer Engine's context-parallel attention is the GPU path.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from megatron_rl.models.mla_attention import MLADotProductAttention
from megatron_rl.parallel.context_parallel import ContextSplit, chunk_positions, gather_for_attention


class ContextParallelAttention(MLADotProductAttention):
    """Local core attention of one CP rank's positions: q, k, v [s / CP, b, heads, dim] (right-padded
    rows) or [t / CP, heads, dim] with `packed_seq_params` (THD)."""

    def __init__(self, config: Any, pg_collection: Any, **kwargs: Any) -> None:
        """`MLADotProductAttention`'s arguments, which Megatron's attention passes by name."""
        # DotProductAttention refuses CP because it sees only this rank's keys; this class gathers
        # them first, so its parent is built from a copy of the config that says CP 1.
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, pg_collection=pg_collection, **kwargs)
        self.cp_group = pg_collection.cp  # Megatron's Attention passes its groups, CP among them

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
        if attention_mask is not None:
            raise ValueError("context-parallel attention builds the causal mask itself: attention_mask must be None")
        size, rank = self.cp_group.size(), self.cp_group.rank()
        split = ContextSplit(size, rank, _bounds(query, size, packed_seq_params))
        width = key.shape[-1]
        gathered = gather_for_attention(torch.cat([key, value], dim=-1), split, 0, self.cp_group)
        keys, values = (t.contiguous() for t in gathered.split([width, value.shape[-1]], dim=-1))
        if packed_seq_params is None:
            return self._attend(query, keys, values, chunk_positions(split.length, size, rank), attention_bias)
        parts, start = [], 0
        for a, b in split.segments:
            held = (b - a) // size
            if held:
                q = query[start : start + held].unsqueeze(1)
                k, v = keys[a:b].unsqueeze(1), values[a:b].unsqueeze(1)
                parts.append(self._attend(q, k, v, chunk_positions(b - a, size, rank), attention_bias))
            start += held
        return torch.cat(parts, dim=0)  # [t / CP, 1, heads x dim]

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, positions: Tensor, bias: Tensor | None) -> Tensor:
        """Megatron's attention of queries at `positions` of their sequence over all its keys (in
        order): True in the mask hides a key, so the keys after each query's position."""
        later = torch.arange(key.shape[0], device=query.device).unsqueeze(0) > positions.to(query.device).unsqueeze(1)
        return DotProductAttention.forward(self, query, key, value, later.view(1, 1, *later.shape), None, bias)


def _bounds(query: Tensor, size: int, packed_seq_params: PackedSeqParams | None) -> tuple[int, ...]:
    """The segment bounds over all CP ranks' positions: (0, S) for right-padded rows; the padded
    `cu_seqlens` of a pack (the split's, as the actor gives them to Megatron)."""
    if packed_seq_params is None:
        return (0, query.shape[0] * size)
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(f"packed attention needs qkv_format 'thd', got {packed_seq_params.qkv_format!r}")
    padded = packed_seq_params.cu_seqlens_q_padded
    bounds = (packed_seq_params.cu_seqlens_q if padded is None else padded).tolist()
    kv_padded = packed_seq_params.cu_seqlens_kv_padded
    kv_bounds = (packed_seq_params.cu_seqlens_kv if kv_padded is None else kv_padded).tolist()
    if bounds != kv_bounds or bounds[-1] != query.shape[0] * size:
        raise ValueError(
            f"context-parallel attention: cu_seqlens {bounds} must be the same for queries and keys and end at "
            f"the {query.shape[0] * size} tokens of all {size} CP ranks ({query.shape[0]} here)"
        )
    return tuple(bounds)
