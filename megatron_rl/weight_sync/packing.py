"""Buckets packed for sending (no Megatron code here): SGLang's flattened-bucket form in a new
buffer per bucket, the test for the distributed flattened layout, and one item of look-ahead."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

import torch

from megatron_rl.models.shard_peers import file_system_sharing
from megatron_rl.rollout.wire import FlattenedTensorMetadata, flattened_layout
from megatron_rl.weight_sync.send import tensor_specs

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


def pack_bucket(
    bucket: Bucket, buffers: PackBuffers | None = None
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """The bucket in SGLang's flattened-bucket form, in a uint8 buffer on the tensors' device.

    The receiver views bytes [start_idx, end_idx) of each tensor as its dtype, so each tensor
    starts at an ALIGN-byte offset, whatever the dtypes (SGLang's `reconstruct_tensors` reads any
    offsets). A CPU buffer lives in shared memory (file-system strategy), so the engine maps it
    instead of copying it through the pickle. Without `buffers` the buffer is new; with them, see
    `PackBuffers` for when one is reused.
    """
    if not bucket:
        raise ValueError("cannot pack an empty bucket")
    meta, offset = [], 0
    for name, tensor in bucket:
        offset = -(-offset // ALIGN) * ALIGN
        size = tensor.numel() * tensor.element_size()
        meta.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + size, size))
        offset += size
    device = bucket[0][1].device
    buffer = shareable_empty(offset, device) if buffers is None else buffers.empty(offset, device)
    for (_, tensor), m in zip(bucket, meta, strict=True):
        buffer[m.start_idx : m.end_idx].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return buffer, meta


class PackBuffers:
    """Where one sender's packed buckets go, one request in flight at a time.

    On a GPU every bucket gets a new buffer: SGLang answers `/update_weights_from_tensor` once its
    device copies are queued, not done, so a reused buffer could be overwritten under a copy still
    reading it (torch keeps a buffer shared by CUDA IPC alive until the engine releases it). A host
    buffer has been read by the time the engine answers (a copy out of pageable host memory returns
    once the source is read), so on the CPU one shared-memory buffer is reused, grown when a bucket
    needs more: making and first touching new shared memory costs several times the copy itself.
    """

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None

    def empty(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A shareable uint8 buffer of `nbytes` on `device` (see the class docstring for reuse)."""
        if device.type != "cpu":
            return shareable_empty(nbytes, device)
        if self._host is None or self._host.numel() < nbytes:
            self._host = None  # frees the old one before the new one is made
            self._host = shareable_empty(nbytes, device)
        return self._host[:nbytes]


def shareable_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """A new uint8 buffer another process can open: shared memory on the CPU (made there directly,
    not copied into), any CUDA memory (IPC)."""
    if device.type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    with file_system_sharing():
        storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)
