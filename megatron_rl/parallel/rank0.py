"""Work that only global rank 0 does, with its result or its failure given to every rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class RankZeroError(RuntimeError):
    """A failure on rank 0 (rollout, reward, evaluation), raised on every rank with its message."""


def on_rank0(fn: Callable[[], T]) -> T:
    """`fn()` run on rank 0 and its result given to every rank (collective); if it raises, every
    rank raises (rank 0 its own exception, the others `RankZeroError` with its message)."""
    world = dist.get_world_size()
    if world == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as err:
            box[0] = ("error", f"{type(err).__name__}: {err}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RankZeroError(f"rank 0 failed: {value}")
    return value
