"""Megatron's local core attention for multi-latent attention (MLA, DeepSeek-V3) on the local spec.

MLA's core attention gets queries and keys of `qk_nope_head_dim + qk_rope_head_dim` channels and
values of `v_head_dim` (`k_channels` / `v_channels`), with MLA's softmax scale (yarn's mscale
squared over the square root of the query head dimension). Megatron's local `DotProductAttention`
takes neither argument (only Transformer Engine's does); its computation is right for keys and
values of different widths except for the width of its output, which this class sets to
`v_head_dim` x heads of the partition. Packed (THD) sequences go through `PackedDotProductAttention`.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.models.packed_attention import PackedDotProductAttention


class MLADotProductAttention(PackedDotProductAttention):
    """Local core attention with queries/keys of `k_channels` and values of `v_channels` per head
    (the scores' width needs no setting: they are computed from the tensors)."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if v_channels is not None:  # None: Attention's own placeholder, which MLA replaces at once
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
