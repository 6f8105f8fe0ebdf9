"""The weight-update wire formats both sides share: the trainer's weight sync and the local engine.

- `init_weights_update_group` / `join_weights_update_group`: the process group SGLang builds for `/init_weights_update_group`:
  a tcp rendezvous store, wrapped in `PrefixStore(group_name)`, handed to torch's own group helper.
  Both sides must build it the same way (not with `init_process_group`), the trainer as rank 0.
- `deserialize_named_tensors`: reads the `/update_weights_from_tensor` payload, base64 of a
  `ForkingPickler` dump of `[(name, tensor), ...]` as SGLang's `MultiprocessingSerializer` writes
  it (the trainer's writer is `megatron_rl/weight_sync/send.py`). Unpickling accepts a subset of
  the globals SGLang's `SafeUnpickler` accepts: torch's tensor-rebuild functions (shared-memory
  file, CUDA IPC with the device named by UUID or index), dtypes, sizes, plain containers and
  SGLang's `FlattenedTensorMetadata`. A shared-memory segment is mapped only when its name is one
  the sender announced (`shm_names`: the segments the trainer created for this request), so a
  payload cannot make the engine map another process's memory by name.
- `FlattenedTensorMetadata` / `flattened_layout` / `unflatten_tensors`: the "flattened_bucket"
  layout: tensors' bytes back to back in one uint8 buffer.
"""

from __future__ import annotations

import base64
import datetime
import inspect
import io
import pickle
import threading
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def init_weights_update_group(*args: Any, **kwargs: Any) -> dist.ProcessGroup:
    """`join_weights_update_group`'s group (the trainer's side keeps no reference to the store)."""
    return join_weights_update_group(*args, **kwargs)[0]


def join_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 600.0,
    store_timeout_s: float | None = None,
) -> tuple[dist.ProcessGroup, dist.Store]:
    """Join the weight-update group as SGLang does (`init_custom_process_group`): rank 0 hosts the
    store. Returns the group and its store (keys under `group_name`).

    `timeout_s` bounds the group's collectives; `store_timeout_s` (default `timeout_s`) the rendezvous,
    so that a store that cannot be reached fails soon.

    The store is built directly rather than through `c10d.rendezvous("tcp://...")`: under torchrun,
    TORCHELASTIC_USE_AGENT_STORE=True makes that rendezvous connect every rank, rank 0 included, to the
    elastic agent's store, which exists only at MASTER_PORT, so nobody would host this group's port.
    """
    from torch.distributed import distributed_c10d as c10d

    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    store_timeout = datetime.timedelta(seconds=timeout_s if store_timeout_s is None else store_timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=store_timeout)
    store = c10d.PrefixStore(group_name, store)
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store, group_name=group_name, timeout=timeout, **{options: None}
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group, store


def destroy_weights_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def in_daemon_thread(fn: Any, *args: Any) -> Future:
    """Run `fn(*args)` on a daemon thread (a rendezvous that never completes must not block exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            future.set_exception(err)

    threading.Thread(target=run, name="weight-update-group", daemon=True).start()
    return future


# ---- the flattened-bucket layout and the tensor payload ----


@dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket: SGLang's class of this name, field for field. Payloads
    carry it under SGLang's name (`SGLANG_METADATA_CLASS`; `weight_sync.send` writes it so), which
    is the only metadata class SGLang's unpickler admits."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flattened_layout(
    names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> list[FlattenedTensorMetadata]:
    """Byte ranges of tensors packed back to back; each must start at a multiple of its item size."""
    meta, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if offset % dtype.itemsize:
            raise ValueError(f"tensor {name!r}: byte offset {offset} is not aligned to {dtype}")
        size = torch.Size(shape).numel() * dtype.itemsize
        meta.append(FlattenedTensorMetadata(name, torch.Size(shape), dtype, offset, offset + size, size))
        offset += size
    return meta


def unflatten_tensors(flat: torch.Tensor, meta: list[FlattenedTensorMetadata]) -> list[tuple[str, torch.Tensor]]:
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor must be a 1-D uint8 tensor, got {flat.dtype} {list(flat.shape)}")
    out = []
    for m in meta:
        if not (0 <= m.start_idx <= m.end_idx <= flat.numel()):
            raise ValueError(f"tensor {m.name!r}: bytes [{m.start_idx}, {m.end_idx}) lie outside the bucket")
        out.append((m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)))
    return out


# SGLang's `SafeUnpickler` (sglang/srt/utils/common.py) admits an exact list of globals. The local
# engine admits a subset of it (tests/test_sglang_compat.py checks that against SGLang's own list),
# so a payload it accepts is one SGLang accepts too.
SGLANG_METADATA_CLASS = ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
_REBUILD_CUDA = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "float8_e5m2",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
)
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {("builtins", n) for n in ("list", "tuple", "dict", "int", "float", "str", "bool", "bytes", "bytearray", "slice")}
    | {("torch", n) for n in DTYPES}
    | {
        ("collections", "OrderedDict"),
        ("copyreg", "__newobj__"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch", "Tensor"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch.multiprocessing.reductions", "rebuild_tensor"),
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
        _REBUILD_CUDA,
        SGLANG_METADATA_CLASS,
    }
)


def cuda_device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` (what SGLang's patched reductions put in a CUDA-IPC handle)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_device_index(device: int | str) -> int:
    """A CUDA-IPC handle's device (an index, or a UUID as SGLang's `patch_torch` writes it) as this
    process's device index: processes with different CUDA_VISIBLE_DEVICES number GPUs differently."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if cuda_device_uuid(index) == device:
            return index
    raise pickle.UnpicklingError(f"CUDA-IPC handle for device {device!r}: no visible GPU has this UUID")


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    from torch.multiprocessing import reductions

    device = 6  # the storage-device argument of torch's rebuild_cuda_tensor (as SGLang's patch_torch)
    args = (*args[:device], cuda_device_index(args[device]), *args[device + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


_REBUILD_SHM = ("torch.multiprocessing.reductions", "rebuild_storage_filename")


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, shm_names: Collection[str]) -> None:
        super().__init__(file)
        self.shm_names = frozenset(shm_names)

    def _rebuild_storage_filename(self, cls: Any, manager: bytes, handle: bytes, *args: Any) -> Any:
        from torch.multiprocessing import reductions

        name = handle.decode(errors="replace") if isinstance(handle, bytes) else str(handle)
        if name not in self.shm_names:
            raise pickle.UnpicklingError(
                f"shared-memory segment {name!r} is not one the sender announced (shm_names: "
                f"{sorted(self.shm_names)[:4]}{' ...' if len(self.shm_names) > 4 else ''}); refused"
            )
        return reductions.rebuild_storage_filename(cls, manager, handle, *args)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == SGLANG_METADATA_CLASS:
            return FlattenedTensorMetadata
        if (module, name) == _REBUILD_CUDA:
            return _rebuild_cuda_tensor
        if (module, name) == _REBUILD_SHM:
            return self._rebuild_storage_filename
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        hint = ""
        if name == "rebuild_storage_fd" or module == "multiprocessing.resource_sharer":
            hint = " (CPU tensors must be shared with the file_system strategy: use megatron_rl.weight_sync.send.serialize_named_tensors)"
        elif name == "FlattenedTensorMetadata":
            hint = f" (SGLang's unpickler admits only {'.'.join(SGLANG_METADATA_CLASS)})"
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not allowed in a weight-update payload (SGLang 0.5.23 refuses it){hint}"
        )


def deserialize_named_tensors(payload: str | bytes, shm_names: Collection[str] = ()) -> Any:
    """Inverse of `weight_sync.send.serialize_named_tensors`, restricted to tensors and plain
    containers, mapping only the shared-memory segments named in `shm_names`."""
    import torch.multiprocessing.reductions  # noqa: F401

    raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    return _RestrictedUnpickler(io.BytesIO(raw), shm_names).load()
