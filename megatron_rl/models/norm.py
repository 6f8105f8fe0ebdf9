"""RMSNorm for Megatron's local layer specs that also works with sequence parallel."""

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
