"""Loss metrics as statistics that reduce exactly across micro-batches and data-parallel ranks.

`policy_loss` returns a dict of detached 0-dim float64 tensors on the input's device. Reduce
every key with `metric_reduce_op(key)`: keys ending in `_max` with MAX, in `_min` with MIN, all
others (counts, sums, loss shares) with SUM. `merge_metrics` does that locally over a list of
micro-batch dicts; an actor then all-reduces each key over the DP group with the same op (with a
global normaliser, the SUM of `loss` equals the whole-batch loss). `finalize_metrics` turns the
reduced statistics into readable floats: `x_sum` -> `x_mean = x_sum / tokens`,
`x_tokens` -> `x_frac = x_tokens / tokens`, everything else unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def metric_reduce_op(key: str) -> str:
    """'max', 'min' or 'sum': how `key` combines across micro-batches and ranks."""
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    return "sum"


def merge_metrics(parts: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Reduce micro-batch metric dicts (same keys) into one, key by key with `metric_reduce_op`."""
    parts = list(parts)
    if not parts:
        raise ValueError("merge_metrics: no metric dicts given")
    keys = set(parts[0])
    for k, part in enumerate(parts[1:], start=1):
        if set(part) != keys:
            raise ValueError(f"merge_metrics: part {k} has keys {sorted(part)}, part 0 has {sorted(keys)}")
    ops = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}
    return {key: ops[metric_reduce_op(key)](torch.stack([p[key] for p in parts])) for key in parts[0]}


def finalize_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Readable floats from reduced statistics: means and fractions per response token."""
    tokens = float(stats["tokens"])
    out: dict[str, float] = {}
    for key, value in stats.items():
        value = float(value)
        if key.endswith("_sum"):
            out[key[: -len("_sum")] + "_mean"] = value / tokens if tokens else float("nan")
        elif key.endswith("_tokens"):
            out[key[: -len("_tokens")] + "_frac"] = value / tokens if tokens else float("nan")
        else:
            out[key] = value
    return out


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of `values` over the bool `mask`, detached, as float64."""
    return torch.where(mask, values.detach(), 0.0).sum().to(torch.float64)


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over the bool `mask` (-inf when empty: the identity of MAX), float64, detached."""
    return torch.where(mask, values.detach(), float("-inf")).amax().to(torch.float64)


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Min over the bool `mask` (+inf when empty: the identity of MIN), float64, detached."""
    return torch.where(mask, values.detach(), float("inf")).amin().to(torch.float64)


def count(mask: torch.Tensor) -> torch.Tensor:
    """Number of true entries of a bool tensor, float64."""
    return mask.sum().to(torch.float64)
