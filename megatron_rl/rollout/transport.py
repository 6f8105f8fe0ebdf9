"""How weights travel to an engine, shared by the trainer side and the local engine.

- `init_weights_update_group`: the process group SGLang builds for `/init_weights_update_group`:
  a tcp rendezvous store, wrapped in `PrefixStore(group_name)`, handed to torch's own group helper.
  Both sides must build it the same way (not with `init_process_group`), the trainer as rank 0.
- `serialize_named_tensors` / `deserialize_named_tensors`: the `/update_weights_from_tensor`
  payload, base64 of a `ForkingPickler` dump of `[(name, tensor), ...]` as SGLang's
  `MultiprocessingSerializer` writes it. CPU tensors travel through shared memory (file-system
  strategy, so unrelated processes can open them; file descriptors cannot cross unrelated
  processes) and must stay alive until the call returns. Unpickling accepts only torch's
  tensor-rebuild functions (shared-memory file, CUDA IPC), dtypes, sizes and plain containers.
- `FlattenedTensorMetadata` / `flatten_tensors` / `unflatten_tensors`: the "flattened_bucket"
  layout: tensors' bytes back to back in one uint8 buffer.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import inspect
import io
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def init_weights_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 600.0,
) -> dist.ProcessGroup:
    """Join the weight-update group as SGLang does (`init_custom_process_group`): rank 0 hosts the store.

    The store is built directly rather than through `c10d.rendezvous("tcp://...")`: under torchrun,
    TORCHELASTIC_USE_AGENT_STORE=True makes that rendezvous connect every rank, rank 0 included, to the
    elastic agent's store, which exists only at MASTER_PORT, so nobody would host this group's port.
    """
    from torch.distributed import distributed_c10d as c10d

    if not group_name:
        raise ValueError("group_name must not be empty")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
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
    return group


def destroy_weights_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


# ---- tensors as one pickled payload ----


@dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket (same fields as SGLang's class of this name)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Concatenate the tensors' bytes (uint8) and describe where each one lies."""
    if not named:
        raise ValueError("cannot flatten an empty list of tensors")
    pieces, meta, offset = [], [], 0
    for name, tensor in named:
        raw = tensor.detach().contiguous().flatten().view(torch.uint8)
        pieces.append(raw)
        meta.append(
            FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + raw.numel(), raw.numel())
        )
        offset += raw.numel()
    return torch.cat(pieces), meta


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


@contextlib.contextmanager
def _file_system_sharing():
    import torch.multiprocessing as tmp

    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(previous)


def serialize_named_tensors(obj: Any) -> str:
    """Base64 `ForkingPickler` dump of `obj` (a list of (name, tensor) or a flattened bucket dict)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401  (registers the shared-memory reducers)

    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


_ALLOWED: set[tuple[str, str]] = {
    ("builtins", n) for n in ("list", "tuple", "dict", "int", "float", "str", "bool", "bytes", "bytearray", "slice")
} | {
    ("collections", "OrderedDict"),
    ("copyreg", "__newobj__"),
    ("copyreg", "_reconstructor"),
    ("torch", "Size"),
    ("torch", "device"),
    ("torch", "Tensor"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
}
_METADATA_CLASSES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    (__name__, "FlattenedTensorMetadata"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        hint = ""
        if name == "rebuild_storage_fd" or module == "multiprocessing.resource_sharer":
            hint = " (CPU tensors must be shared with the file_system strategy: use serialize_named_tensors)"
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a weight-update payload{hint}")


def deserialize_named_tensors(payload: str | bytes) -> Any:
    """Inverse of `serialize_named_tensors`, restricted to tensors and plain containers."""
    import torch.multiprocessing.reductions  # noqa: F401

    raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    return _RestrictedUnpickler(io.BytesIO(raw)).load()


# ---- the trainer's side of /update_weights_from_distributed ----


def tensor_specs(named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of the tensors, as `/update_weights_from_distributed` announces them."""
    names = [n for n, _ in named]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
    shapes = [list(t.shape) for _, t in named]
    return names, dtypes, shapes


def broadcast_named_tensors(
    group: dist.ProcessGroup,
    named: list[tuple[str, torch.Tensor]],
    flattened: bool = False,
    reply: Any = None,
    timeout_s: float = 600.0,
    poll_s: float = 0.01,
) -> int:
    """Rank 0's half of a distributed update: broadcast the tensors in the announced order.

    `reply` is the pending `/update_weights_from_distributed` call (a `concurrent.futures.Future`):
    if the engine refuses the request before receiving, this raises its error instead of waiting
    for the broadcast to time out. Returns the number of bytes sent.
    """
    import time

    if flattened:
        flat, _ = flatten_tensors(named)
        buffers = [flat]
    else:
        buffers = [t.detach().contiguous() for _, t in named]
    works = [dist.broadcast(b, src=0, group=group, async_op=True) for b in buffers]
    deadline = time.monotonic() + timeout_s
    while not all(w.is_completed() for w in works):
        if reply is not None and reply.done() and reply.exception() is not None:
            raise RuntimeError(
                f"the engine refused the update before receiving it ({reply.exception()}); "
                "the weight-update group is now out of step: destroy and re-create it"
            ) from reply.exception()
        if time.monotonic() > deadline:
            raise TimeoutError(f"broadcast of {len(named)} tensors did not finish within {timeout_s:.0f} s")
        time.sleep(poll_s)
    for work in works:
        work.wait()
    return sum(b.numel() * b.element_size() for b in buffers)
