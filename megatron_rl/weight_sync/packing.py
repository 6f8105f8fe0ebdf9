"""Buckets packed for sending (no Megatron code here): SGLang's flattened-bucket form in a new
buffer per bucket, the test for the distributed flattened layout, and one item of look-ahead."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from megatron_rl.rollout.wire import FlattenedTensorMetadata, flattened_layout
from megatron_rl.weight_sync.send import file_system_sharing, tensor_specs

Bucket = list[tuple[str, torch.Tensor]]
T = TypeVar("T")
ALIGN = 16  # bytes: every packed tensor starts at a multiple of this (and so of its item size)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, is_last) for each item: one item of look-ahead."""
    it = iter(items)
    try:
        previous = next(it)
    except StopIteration:
        return
    for item in it:
        yield previous, False
        previous = item
    yield previous, True


def broadcasts_flat(bucket: Bucket) -> bool:
    """Whether the bucket fits SGLang's distributed "flattened_bucket" layout (tensors back to back,
    each at a multiple of its item size, which holds for one dtype); otherwise send tensor by tensor."""
    names, _, shapes = tensor_specs(bucket)
    try:
        flattened_layout(names, [t.dtype for _, t in bucket], shapes)
    except ValueError:
        return False
    return True


def pack_bucket(bucket: Bucket) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """The bucket in SGLang's flattened-bucket form, in a new uint8 buffer on the tensors' device.

    The receiver views bytes [start_idx, end_idx) of each tensor as its dtype, so each tensor
    starts at an ALIGN-byte offset, whatever the dtypes (SGLang's `reconstruct_tensors` reads any
    offsets). A CPU buffer lives in shared memory (file-system strategy), so the engine maps it
    instead of copying it through the pickle. The buffer is new for every bucket: SGLang answers
    `/update_weights_from_tensor` once its copies are queued, not done, so a reused buffer could be
    overwritten under a copy still reading it; torch keeps a CUDA buffer shared by IPC alive until
    the engine releases it.
    """
    if not bucket:
        raise ValueError("cannot pack an empty bucket")
    meta, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // ALIGN) * ALIGN
        size = tensor.numel() * tensor.element_size()
        meta.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + size, size))
        offset += size
    buffer = shareable_empty(offset, bucket[0][1].device)
    for (_, tensor), m in zip(bucket, meta, strict=True):
        buffer[m.start_idx : m.end_idx].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return buffer, meta


def shareable_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A new uint8 buffer another process can open: shared memory on the CPU, any CUDA memory (IPC)."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        with file_system_sharing():
            buffer.share_memory_()
    return buffer
