"""Megatron model -> Hugging Face tensors, in buckets: used by weight sync and the converter.

    for bucket in export_hf_weights(chunks, model, bucket_mb=512):   # on EVERY rank, to the end
        send(bucket)                                                   # [(hf_name, tensor), ...]

Every rank walks its parameters in the same order and takes part in the gathers: TP shards
(and expert-TP shards) go to TP rank 0, and only data-parallel replica 0 takes part. Experts are
named by their global id. The ranks that end up holding tensors, and the only ones the generator
yields on, are the *senders* (`is_export_sender`): the first rank of each pipeline stage, with its
stage's dense tensors, and

- by default (`ep_senders=False`: the converter) that same rank with every expert of the stage,
  gathered from all EP ranks;
- with `ep_senders=True` (weight sync) the first rank of each expert-parallel rank with that EP
  rank's own experts, nothing gathered across EP: each expert leaves from where it lives. Not for a
  family whose checkpoints stack a layer's experts into one tensor (`fused_experts`: gpt-oss), which
  one rank must assemble (`sends_experts_per_rank`).

Other ranks hold no gathered tensor and get an empty generator that must still be run to its end
(it joins the collectives).

Tensors are full HF checkpoint tensors on the parameters' device, contiguous, vocabulary padding
removed. No copy is made where none is needed: a tensor may be the parameter itself or a view of
it (gate/up halves), so read them before the next optimizer step and never modify them.
A bucket holds at most `bucket_mb` MiB, unless a single tensor is larger (then it is alone), and
holds expert tensors only or none: routed experts are bucketed apart from the dense weights. A
TP-split parameter is gathered straight into one preallocated full tensor (`shard_gather`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.utils import unwrap_model

from megatron_rl.config import ModelConfig
from megatron_rl.models.fused_experts import ExpertFuser, stacks_experts
from megatron_rl.models.hf_config_sigmoid import mtp_dropped_config
from megatron_rl.models.hf_io import ShardedSafetensorsWriter, copy_assets, finalize_hf_folder, write_hf_config
from megatron_rl.models.hf_mapping import HFMapping
from megatron_rl.models.init import ParamShard, iter_param_shards
from megatron_rl.models.shard_gather import gather_full, join_shards
from megatron_rl.models.shard_peers import PeerShards, export_memory

_EXPERT_ID = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")
Bucket = list[tuple[str, torch.Tensor]]


def _dense_sender() -> bool:
    return ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank(with_context_parallel=True) == 0


def _expert_sender(any_ep_rank: bool = False) -> bool:
    """The first rank of EP rank 0 (or, with `any_ep_rank`, of this rank's EP rank)."""
    return (
        ps.get_expert_tensor_parallel_rank() == 0
        and (any_ep_rank or ps.get_expert_model_parallel_rank() == 0)
        and ps.get_expert_data_parallel_rank() == 0
    )


def sends_experts_per_rank(model: ModelConfig) -> bool:
    """The `ep_senders` of weight sync: each EP rank sends its own experts, unless the checkpoint stacks a
    layer's experts into one tensor (gpt-oss), which the first EP rank assembles from all of them."""
    return not stacks_experts(model.family)


def splits_experts(ep_senders: bool) -> bool:
    """Whether each EP rank sends its own experts (`ep_senders` and expert parallelism in use)."""
    return ep_senders and ps.get_expert_model_parallel_world_size() > 1


def is_export_sender(ep_senders: bool = False) -> bool:
    """Whether `export_hf_weights(..., ep_senders=ep_senders)` yields tensors on this rank (see the
    module docstring)."""
    return _dense_sender() or (splits_experts(ep_senders) and _expert_sender(any_ep_rank=True))


def _gather_to_first(tensor: torch.Tensor, group: dist.ProcessGroup) -> list[torch.Tensor] | None:
    """Every member's `tensor` on the group's first rank (in group-rank order); None elsewhere."""
    if dist.get_world_size(group) == 1:
        return [tensor]
    first = dist.get_rank(group) == 0
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))] if first else None
    dist.gather(tensor.detach().contiguous(), parts, group=group, group_dst=0)
    return parts


def _full_tensor(shard: ParamShard, peers: PeerShards, index: int) -> torch.Tensor | None:
    """The unsplit parameter on (expert-)TP rank 0, gathered straight into one full tensor
    (`shard_gather`), or copied from the members' own memory when `peers` are shared (split
    parameter `index` of the group); None on the other (expert-)TP ranks."""
    first = dist.get_rank(peers.group) == 0
    if shard.partition_dim is None:
        return shard.param.detach() if first else None
    if not peers.shared:
        return gather_full(shard, peers.group)
    if not first:
        return None
    assert peers.memory is not None
    local = shard.param.detach()
    full = peers.memory.full_buffer(shard.global_name, shard.full_shape, local)
    return join_shards(shard, [local, *peers.of(index)], full)


def _exported_shards(chunks: list[torch.nn.Module], model: ModelConfig) -> list[ParamShard]:
    """This rank's parameters the export walks (the tied output layer of the last stage is a copy
    of the first stage's embedding)."""
    return [
        s
        for s in iter_param_shards(chunks, model)
        if not (s.local_name.endswith("output_layer.weight") and s.global_name != "output_layer.weight")
    ]


def _full_params(
    chunks: list[torch.nn.Module], model: ModelConfig, ep_senders: bool
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(global Megatron name, full tensor, whether it is an expert's) of this stage, yielded on the
    senders only (see the module docstring)."""
    dense_replica = ps.get_data_parallel_rank(with_context_parallel=True) == 0
    expert_replica = ps.get_expert_data_parallel_rank() == 0
    ep_size = ps.get_expert_model_parallel_world_size()
    local_experts = (model.num_experts or 0) // ep_size
    split = splits_experts(ep_senders)
    shards = _exported_shards(chunks, model)
    taking_part = {False: dense_replica, True: expert_replica}  # by is_expert
    split_params: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    split_index: dict[int, int] = {}  # id(shard) -> its index among its group's split parameters
    for shard in shards:
        if taking_part[shard.is_expert] and shard.partition_dim is not None:
            split_index[id(shard)] = len(split_params[shard.is_expert])
            split_params[shard.is_expert].append(shard.param)
    memory = export_memory(chunks[0]) if next(iter(chunks[0].parameters())).device.type == "cpu" else None
    peers = {
        False: PeerShards(ps.get_tensor_model_parallel_group(), split_params[False], memory, expert=False),
        True: PeerShards(ps.get_expert_tensor_parallel_group(), split_params[True], memory, expert=True),
    }
    yield from _full_tensors(shards, peers, split_index, taking_part, split, local_experts)
    for group_peers in peers.values():
        group_peers.close()


def _full_tensors(
    shards: list[ParamShard],
    peers: dict[bool, PeerShards],
    split_index: dict[int, int],
    taking_part: dict[bool, bool],
    split: bool,
    local_experts: int,
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """`_full_params`' walk over the shards, once the groups' peers are known."""
    for shard in shards:
        if not taking_part[shard.is_expert]:
            continue
        full = _full_tensor(shard, peers[shard.is_expert], split_index.get(id(shard), -1))
        if full is None:
            continue
        if not shard.is_expert:
            yield shard.global_name, full, False
            continue
        # this EP rank's own experts, or every EP rank's gathered on EP rank 0, in EP rank order
        experts = [full] if split else _gather_to_first(full, ps.get_expert_model_parallel_group())
        if experts is None:
            continue
        match = _EXPERT_ID.search(shard.global_name)
        assert match is not None, shard.global_name
        index = int(match.group(1))  # this EP rank's global id of the expert
        for offset, tensor in enumerate(experts):
            expert = index + offset * local_experts
            name = (
                shard.global_name[: match.start()]
                + f".mlp.experts.local_experts.{expert}."
                + shard.global_name[match.end() :]
            )
            yield name, tensor, True


@torch.no_grad()
def export_hf_weights(
    chunks: list[torch.nn.Module],
    model: ModelConfig,
    *,
    bucket_mb: float = 512,
    dtype: torch.dtype | None = None,
    ep_senders: bool = False,
) -> Iterator[Bucket]:
    """Buckets of (HF checkpoint name, full tensor) of this pipeline stage, on its senders (see the
    module docstring); `dtype` casts every tensor. Run it to the end on every rank."""
    if model.num_experts is not None and _dense_sender() != _expert_sender():
        raise RuntimeError(
            f"rank {dist.get_rank()}: the first rank of the stage is not the same for dense and expert "
            "parameters under this rank order; the exporter needs them to coincide"
        )
    mapping = HFMapping(model)
    if stacks_experts(model.family) and splits_experts(ep_senders):
        raise RuntimeError(f"{model.family} stacks a layer's experts: export them with ep_senders = False")
    fuser = ExpertFuser(model.family, model.num_experts or 0)
    limit = int(bucket_mb * 2**20)
    open_buckets: dict[bool, tuple[Bucket, int]] = {False: ([], 0), True: ([], 0)}  # by is_expert
    for megatron_name, full, expert in _full_params([unwrap_model(c) for c in chunks], model, ep_senders):
        for name, tensor in (t for pair in mapping.to_hf(megatron_name, full) for t in fuser.add(*pair)):
            if dtype is not None:
                tensor = tensor.to(dtype)
            nbytes = tensor.numel() * tensor.element_size()
            bucket, size = open_buckets[expert]
            if bucket and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, tensor))
            open_buckets[expert] = (bucket, size + nbytes)
    fuser.check_done()
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def save_hf_folder(
    chunks: list[torch.nn.Module],
    model: ModelConfig,
    out: str | os.PathLike,
    hf_config: dict[str, Any],
    *,
    assets_from: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    bucket_mb: float = 512,
    max_shard_mb: float = 5000,
    progress: Callable[[int], None] | None = None,
    ep_senders: bool = False,
    in_place: bool = False,
) -> list[str]:
    """Write the model as a Hugging Face folder `out` (existing; shared by all ranks): sharded
    safetensors, index, `hf_config` as config.json, generation/tokenizer files of `assets_from`.
    Collective; each sender (`is_export_sender(ep_senders)`) writes its own tensors, rank 0 names
    the files and writes the index. Returns the safetensors file names (on every rank).

    `in_place` (weight sync): the files keep the names their senders gave them
    (`part-pp<stage>[-ep<rank>]-<k>.safetensors`, listed in the index), a file of the same size
    already there is overwritten in place (its page-cache pages reused), and safetensors files of
    an earlier layout are removed. Otherwise (`out` empty) they are renamed to
    `model-0000i-of-0000n.safetensors` as Hugging Face names them."""
    out = Path(out)
    stage = ps.get_pipeline_model_parallel_rank()
    ep = ps.get_expert_model_parallel_rank() if splits_experts(ep_senders) else None
    prefix = f"part-pp{stage:03d}" + ("" if ep is None else f"-ep{ep:03d}")
    writer = ShardedSafetensorsWriter(out, prefix, int(max_shard_mb * 2**20), overwrite=in_place)
    failed: OSError | None = None  # a write that failed (a full disk): the export's collectives go on, unwritten
    for bucket in export_hf_weights(chunks, model, bucket_mb=bucket_mb, dtype=dtype, ep_senders=ep_senders):
        try:
            for name, tensor in bucket if failed is None else ():
                writer.add(name, tensor)
        except OSError as err:
            failed = err
        if progress is not None:
            progress(len(bucket))
    try:
        if failed is None and dist.get_rank() == 0:  # the 0-width tensors transformers writes without shared experts
            for name, shape in HFMapping(model).empty_hf_shapes().items():
                writer.add(name, torch.empty(shape, dtype=dtype or _param_dtype(chunks)))
        if failed is None:
            writer.flush()
    except OSError as err:
        failed = err
    written: list[tuple[tuple[int, int] | None, list, OSError | None]] = [(None, [], None)] * dist.get_world_size()
    sender = (stage, ep or 0) if is_export_sender(ep_senders) else None
    dist.all_gather_object(written, (sender, writer.files if sender else [], failed))
    failures = [w[2] for w in written if w[2] is not None]
    if failures:  # every rank raises the first one
        raise failures[0]
    senders = sorted((w for w in written if w[0] is not None), key=lambda w: w[0])
    files = [f for _, sender_files, _ in senders for f in sender_files]
    result: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            result[0] = _finish_folder(
                out, files, model, hf_config, assets_from, dtype or _param_dtype(chunks), rename=not in_place
            )
        except OSError as err:
            result[0] = err
    dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], str):
        raise RuntimeError(result[0])
    if isinstance(result[0], OSError):
        raise result[0]
    return result[0]


def _param_dtype(chunks: list[torch.nn.Module]) -> torch.dtype:
    return next(iter(chunks[0].parameters())).dtype


def _finish_folder(
    out: Path,
    files: list[tuple[str, list[str], int]],
    model: ModelConfig,
    hf_config: dict[str, Any],
    assets_from: str | os.PathLike | None,
    dtype: torch.dtype,
    rename: bool,
) -> list[str] | str:
    """Rank 0's part of `save_hf_folder`: the final file names, or an error message for all ranks."""
    names = [n for _, file_names, _ in files for n in file_names]
    mapping = HFMapping(model)
    expected = {**mapping.checkpoint_shapes(), **mapping.empty_hf_shapes()}
    if sorted(names) != sorted(expected):
        missing, extra = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
        return f"export wrote a wrong tensor set: missing {missing[:3]}, unexpected {extra[:3]}"
    final = finalize_hf_folder(out, files, rename=rename)
    write_hf_config(out, mtp_dropped_config(hf_config), dtype)  # the MTP layers are not exported
    if assets_from is not None:
        copy_assets(assets_from, out)
    return final
