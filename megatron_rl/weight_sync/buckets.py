"""The exported weights as one stream of buckets on rank 0.

`export_hf_weights` yields each pipeline stage's tensors on that stage's sender. The distributed
and tensor modes talk to the engine from global rank 0 only. So with PP > 1, every other stage's
sender sends its buckets to rank 0 point to point, one stage after another: first the names,
dtypes and shapes as one object, then the tensors. Rank 0 forwards each bucket as it arrives.
This gives one weight-update group and one HTTP poster, and the engine sees the same requests as
with PP = 1. The price is one extra hop for stages > 0, and it runs over the trainer's own
interconnect.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_rl.config import ModelConfig
from megatron_rl.models.export import export_hf_weights, is_export_sender
from megatron_rl.weight_sync.packing import Bucket
from megatron_rl.weight_sync.send import tensor_specs


def stage_senders() -> list[int]:
    """Global rank of each pipeline stage's export sender, by stage (collective); rank 0 is stage 0's."""
    stage = ps.get_pipeline_model_parallel_rank() if is_export_sender() else -1
    everyone: list[int] = [-1] * dist.get_world_size()
    dist.all_gather_object(everyone, stage)
    senders: dict[int, int] = {}
    for rank, s in enumerate(everyone):
        if s < 0:
            continue
        if s in senders:
            raise RuntimeError(f"pipeline stage {s} has two export senders, ranks {senders[s]} and {rank}")
        senders[s] = rank
    stages = ps.get_pipeline_model_parallel_world_size()
    if sorted(senders) != list(range(stages)) or senders.get(0) != 0:
        raise RuntimeError(
            f"export senders by stage {senders}: expected one per stage of {stages}, with global rank 0 for stage 0"
        )
    return [senders[s] for s in range(stages)]


def rank0_buckets(
    chunks: list[torch.nn.Module],
    model: ModelConfig,
    senders: list[int],
    bucket_mb: float,
    dtype: torch.dtype | None = None,
) -> Iterator[Bucket]:
    """Every stage's buckets on rank 0, stage by stage; on other ranks the export (and the sending
    of a stage's buckets) runs and nothing is yielded. Run it to the end on every rank."""
    exported = export_hf_weights(chunks, model, bucket_mb=bucket_mb, dtype=dtype)
    device = params_device(chunks)
    rank = dist.get_rank()
    if rank == 0:
        yield from exported
        for src in senders[1:]:
            yield from _receive_buckets(src, device)
    elif rank in senders:
        for bucket in exported:
            _send_bucket(bucket, device)
        dist.send_object_list([None], dst=0, device=device)
    else:
        for _ in exported:
            pass


def params_device(chunks: list[torch.nn.Module]) -> torch.device:
    """Where the model's parameters, hence the exported tensors, live."""
    return next(iter(chunks[0].parameters())).device


def _send_bucket(bucket: Bucket, device: torch.device) -> None:
    dist.send_object_list([tensor_specs(bucket)], dst=0, device=device)
    ops = [dist.P2POp(dist.isend, tensor.contiguous(), 0) for _, tensor in bucket]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _receive_buckets(src: int, device: torch.device) -> Iterator[Bucket]:
    while True:
        box: list = [None]
        dist.recv_object_list(box, src=src, device=device)
        if box[0] is None:
            return
        names, dtypes, shapes = box[0]
        tensors = [torch.empty(s, dtype=getattr(torch, d), device=device) for d, s in zip(dtypes, shapes, strict=True)]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src) for t in tensors]):
            work.wait()
        yield list(zip(names, tensors, strict=True))
