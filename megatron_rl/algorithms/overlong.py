"""DAPO's overlong reward shaping: soft length penalty and overlong filtering."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13 scaled by `factor`, added to the correctness reward; [N] float32.

    With L = `lengths` (response tokens), L_max = `max_len` (`rollout.max_new_tokens`) and
    L_cache = `buffer_len` (`algorithm.overlong_buffer_len`):
    0 if L <= L_max - L_cache; factor * ((L_max - L_cache) - L) / L_cache if L_max - L_cache < L <= L_max;
    -factor if L > L_max. Config: `algorithm.overlong_penalty_factor`.
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"soft_overlong_penalty: buffer_len ({buffer_len}) must be in 1..max_len ({max_len})")
    if lengths.dim() != 1:
        raise ValueError(f"soft_overlong_penalty: lengths must be [N], got shape {tuple(lengths.shape)}")
    expected = max_len - buffer_len
    penalty = (expected - lengths.float()) / buffer_len
    return factor * penalty.clamp(min=-1.0, max=0.0)


def overlong_filter_mask(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The response mask with every truncated response (finish reason "length") removed from the loss.

    `truncated`: [N] bool. Build the loss normaliser from the returned mask so that filtered rows
    count neither as tokens nor as sequences. Config: `algorithm.overlong_filter`.
    """
    if truncated.dim() != 1 or truncated.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"overlong_filter_mask: truncated {tuple(truncated.shape)} must be [N] for response_mask "
            f"{tuple(response_mask.shape)}"
        )
    return response_mask * ~truncated.bool().unsqueeze(-1)
