"""RMSNorm for Megatron's local layer specs that also works with sequence parallel, and the QK-norm over a whole
projection (MiniMax-M2)."""

from __future__ import annotations

from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` whose weight is tagged `sequence_parallel`.

    Megatron's local spec uses `WrappedTorchNorm`, which refuses sequence parallel (and MoE with
    TP needs it). Under SP each TP rank normalises a different slice of the sequence, so the
    norm's weight gradient is partial per rank; the tag makes `finalize_model_grads` all-reduce it
    over the TP group, as Transformer Engine's norm does. Without the tag the gradients of the
    norms (and everything upstream of the router) are silently wrong.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **unused: Any) -> None:
        if config.normalization != "RMSNorm":
            raise ValueError(f"SequenceParallelRMSNorm needs normalization='RMSNorm', got {config.normalization!r}")
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = True


class _ProjectionRMSNorm(torch.nn.Module):
    """RMSNorm over all heads of one projection at once (MiniMax-M2's QK-norm), in place of Megatron's
    per-head `q_layernorm` / `k_layernorm`: input [..., heads of this TP rank, head dim], one root mean
    square over the whole projection (the sum of squares all-reduced over the TP group, in the forward
    and the backward), a weight per channel split over TP with the heads (partition dim 0). Computed in
    fp32 and cast back before the weight, as transformers' RMSNorm."""

    _heads_field = ""  # the TransformerConfig field counting this projection's heads

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **unused: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        tp = ps.get_tensor_model_parallel_world_size()
        heads = getattr(config, self._heads_field)
        if heads % tp:
            raise ValueError(f"{type(self).__name__}: {self._heads_field} = {heads} does not split over TP = {tp}")
        self.width = heads * hidden_size  # the whole projection's
        self.eps = eps
        self.group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        self.weight = torch.nn.Parameter(torch.ones(self.width // tp, dtype=config.params_dtype))
        if tp > 1:
            set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.float().flatten(-2)
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.group is not None:
            import torch.distributed.nn.functional as dist_fn

            squares = dist_fn.all_reduce(squares, group=self.group)
        normed = (flat * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)
        return (self.weight * normed).view_as(x)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, Any]:
        """The weight split over TP along dim 0, as in the forward: Megatron's default would take every rank's
        shard for the whole weight, and a checkpoint would keep one rank's."""
        return norm_sharded_state_dict(self, prefix, sharded_offsets, metadata, tp_split={"weight": 0})


class QueryProjectionRMSNorm(_ProjectionRMSNorm):
    _heads_field = "num_attention_heads"


class KeyProjectionRMSNorm(_ProjectionRMSNorm):
    _heads_field = "num_query_groups"


def norm_sharded_state_dict(
    norm: torch.nn.Module, prefix: str, sharded_offsets: tuple, metadata: dict | None, tp_split: dict[str, int]
) -> dict[str, Any]:
    """The sharded state dict of a norm module of ours: each parameter named in `tp_split` split over TP along that
    dim, the others replicated over TP; all replicated over DP (Megatron's `sharded_state_dict_default` otherwise)."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

    metadata = ensure_metadata_has_dp_cp_group(metadata)
    return make_sharded_tensors_for_checkpoint(
        norm.state_dict(prefix="", keep_vars=True),
        prefix,
        tp_split,
        sharded_offsets,
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_cp_group=metadata["dp_cp_group"],
    )
