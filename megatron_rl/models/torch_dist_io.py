"""Megatron's `torch_dist` checkpoint format, written and read with fewer passes over the bytes.

The files are the ones Megatron's own strategies write and read (`__{rank}_{i}.distcp` holding one
`torch.save` record per tensor, `.metadata`, `common.pt`, `metadata.json`); only the data movement
differs, so a checkpoint of either kind loads with the other and under any layout:

- `DirectSaveStrategy` writes this rank's file in this process. Megatron's writer starts a
  helper (manager) process once per process, forks a writer process per file at every save,
  copies each view (e.g. the gate and up halves of a SwiGLU `linear_fc1`) to a tensor of its own,
  computes a zip CRC32 over every byte and syncs every file to disk. Here a view is written from
  where it is (a tensor on the bytes it covers), in 1 MiB writes (`chunked_io`), without CRC32
  (`torch.load` does not check it), and syncing is optional. The file's SHA-256 is computed from the
  bytes as they are written (`written_digests`), for the checkpoint manifest: no second read.
- `DirectLoadStrategy` reads each tensor's bytes straight into the tensor it is loaded into, and
  unpickles a record's tensor header once per distinct header: Megatron's reader unpickles each
  record into a new tensor and copies that into the target. Vocabulary tensors (`allow_shape_mismatch`)
  stored at the model's shape are not zero-filled first.
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, StateDict
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
    _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys,
    _restore_dict_types,
    _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict,
)
from torch.distributed import checkpoint
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, SerializationFormat, _write_item
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future
from torch.utils.serialization import config as serialization_config

from megatron_rl.models.chunked_io import ChunkedWrites

BACKEND, VERSION = "torch_dist", 1  # what metadata.json names, as for Megatron's default strategy


def _own_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on CPU as a tensor whose storage is exactly its bytes (what `torch.save` writes):
    a contiguous view gets a storage that is a window of its base's, without copying."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() == nbytes:
        return tensor
    if not tensor.is_contiguous():
        return tensor.contiguous()
    start = tensor.storage_offset() * tensor.element_size()
    window = storage[start : start + nbytes]
    return torch.empty(0, dtype=tensor.dtype).set_(window, 0, tensor.shape, tensor.stride())


class _DirectWriter(FileSystemWriterAsync):
    """Writes this rank's items into one file when the request runs, in this process."""

    def __init__(self, path: str | os.PathLike, fsync: bool) -> None:
        super().__init__(path, thread_count=1, sync_files=fsync)
        self._results: Any = None
        self.digests: dict[str, str] = {}  # file name -> SHA-256 of the bytes written

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """One bucket (file) with every item, tensors as they are (Megatron's copies views here)."""
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        by_type: dict[bool, list] = {True: [], False: []}
        for item in plan.items:
            by_type[item.type == WriteItemType.BYTE_IO].append((item, planner.resolve_data(item)))
        buckets = [(os.path.join(self.checkpoint_dir, name), name, (by_type[True], by_type[False]))]
        self.write_buckets = buckets if plan.items else []
        self.results_queue = None

    def get_save_function_and_args(self) -> tuple[Any, Any, list]:
        return (self._write, None, []) if self.write_buckets else (None, None, [])

    def _write(self) -> None:
        path, key, (byte_items, tensor_items) = self.write_buckets[0]
        results = []
        try:
            # No zip CRC32 per record (a pass over every byte): `torch.load`, Megatron's reader,
            # never checks it (torch.serialization.set_crc32_options documents that it loads such files).
            digest = hashlib.sha256()
            with serialization_config.patch({"save.compute_crc32": False}), open(path, "wb") as file:
                stream = ChunkedWrites(file, digest)
                for item, data in byte_items:
                    results.append(
                        _write_item(self.transforms, stream, data, item, key, SerializationFormat.TORCH_SAVE)
                    )
                for item, tensor in tensor_items:
                    data = _own_bytes(tensor)
                    results.append(
                        _write_item(self.transforms, stream, data, item, key, SerializationFormat.TORCH_SAVE)
                    )
                if self.sync_files:
                    os.fsync(stream.fileno())
            self.digests[key] = digest.hexdigest()
            self._results = results
        except Exception as err:  # reported to the coordinator, which fails the save on every rank
            self._results = _wrap_exception(err)

    def retrieve_write_results(self) -> Any:
        return [] if self._results is None else self._results


class DirectSaveStrategy(TorchDistSaveShardedStrategy):
    """Megatron's `torch_dist` save with `_DirectWriter`; `fsync`: sync each file to disk before returning."""

    def __init__(self, fsync: bool = False) -> None:
        super().__init__(BACKEND, VERSION, thread_count=1)
        self.fsync = fsync
        self._writers: list[_DirectWriter] = []

    def written_digests(self) -> dict[str, str]:
        """The SHA-256 of each shard file this process wrote (name in the checkpoint folder -> hex)."""
        return {name: sha for writer in self._writers for name, sha in writer.digests.items()}

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> AsyncRequest:
        sharded, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        writer = _DirectWriter(checkpoint_dir, self.fsync)
        self._writers.append(writer)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        plan = save_state_dict_async_plan(mcore_to_pyt_state_dict(sharded, False), writer, None, 0, planner=planner)
        return self._get_save_and_finalize_callbacks(writer, plan[0])


def _read_exactly(stream: io.RawIOBase, tensor: torch.Tensor, path: str) -> None:
    """Fill the contiguous CPU `tensor` with the next bytes of `stream`."""
    view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = stream.readinto(view[done:])
        if not n:
            raise OSError(f"{path}: file ends {len(view) - done} bytes short of a tensor's data")
        done += n


class _DirectReader(CachedMetadataFileSystemReader):
    """Reads each tensor's bytes into the tensor it is loaded into (one copy, no unpickled tensor)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._layouts: dict[bytes, torch.Tensor] = {}  # a record's pickle -> its tensor on "meta"

    def _stored(self, stream: io.RawIOBase, info: Any) -> tuple[torch.Tensor, int]:
        """The tensor of a `torch.save` record on "meta" (dtype, shape, strides, storage offset) and
        where its storage's bytes start in the file. Records of equal pickles (same dtype, shape
        and strides: every expert of a layer) are unpickled once."""
        view = _create_file_view(stream, info.offset, info.length)
        record = torch._C.PyTorchFileReader(view)
        little = not record.has_record("byteorder") or record.get_record("byteorder") == b"little"
        pickled = bytes(record.get_record("data.pkl")) if little and sys.byteorder == "little" else None
        if pickled in self._layouts:
            return self._layouts[pickled], info.offset + record.get_record_offset("data/0")
        view.seek(0)
        stored = torch.load(view, map_location="meta", weights_only=True)
        start = stored.untyped_storage()._checkpoint_offset
        if pickled is not None and start == record.get_record_offset("data/0"):
            self._layouts[pickled] = stored
        return stored, info.offset + start

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = defaultdict(list)
        for request in plan.items:
            per_file[self.storage_data[request.storage_index].relative_path].append(request)
        for relative_path, requests in per_file.items():
            path = str(self.fs.concat_path(self.path, relative_path))
            with open(path, "rb", buffering=0) as stream:
                for request in sorted(requests, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[request.storage_index]
                    if info.transform_descriptors:  # not written by Megatron: the reader of torch
                        super().read_data(LoadPlan([request]), planner)
                    elif request.type == LoadItemType.BYTE_IO:
                        stream.seek(info.offset)
                        planner.load_bytes(request, io.BytesIO(stream.read(info.length)))
                    else:
                        self._read_tensor(stream, path, info, request, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_tensor(self, stream: io.RawIOBase, path: str, info: Any, request: Any, planner: LoadPlanner) -> None:
        stored, data_start = self._stored(stream, info)
        region = narrow_tensor_by_index(stored, request.storage_offsets, request.lengths)
        target = planner.resolve_tensor(request).detach()
        if target.shape != region.shape:
            raise RuntimeError(
                f"{path}: {request.storage_index.fqn} has shape {list(region.shape)} where "
                f"{list(target.shape)} is loaded"
            )
        direct = (
            region.is_contiguous()
            and target.is_contiguous()
            and target.device.type == "cpu"
            and target.dtype == region.dtype
        )
        if direct:
            stream.seek(data_start + region.storage_offset() * region.element_size())
            _read_exactly(stream, target, path)
        else:  # the record's storage, then Megatron's narrow and copy (casts, strides, devices)
            raw = torch.empty(stored.untyped_storage().nbytes(), dtype=torch.uint8)
            stream.seek(data_start)
            _read_exactly(stream, raw, path)
            whole = torch.empty(0, dtype=stored.dtype).set_(
                raw.untyped_storage(), stored.storage_offset(), stored.shape, stored.stride()
            )
            target.copy_(narrow_tensor_by_index(whole, request.storage_offsets, request.lengths))
        planner.commit_tensor(request, target)


class DirectLoadStrategy(TorchDistLoadShardedStrategy):
    """Megatron's `torch_dist` load with `_DirectReader` (same planner and shape checks)."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Path) -> StateDict:
        reader = _DirectReader(checkpoint_dir)
        stored = reader.read_metadata().state_dict_metadata
        flat, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        for shards in flat.values():
            for i, shard in enumerate(shards):
                if (
                    isinstance(shard, ShardedTensor)
                    and shard.allow_shape_mismatch
                    and getattr(stored.get(shard.key), "size", None) == torch.Size(shard.global_shape)
                ):
                    # Stored as the model has it: read like any other tensor. (Megatron zero-fills
                    # these first, for the rows a checkpoint of a smaller shape leaves unread.)
                    shards[i] = replace(shard, allow_shape_mismatch=False)
        tensors = [t for shards in flat.values() for t in shards if isinstance(t, ShardedTensor)]
        planner = MCoreLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        )
        pyt_state_dict = mcore_to_pyt_state_dict(flat, True)
        checkpoint.load_state_dict(pyt_state_dict, reader, planner=planner)
        self.cached_global_metadata = reader.read_metadata()
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, sharded_state_dict)
        return loaded
