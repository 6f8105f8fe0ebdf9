"""The trainer's side of the wire formats in `megatron_rl/rollout/wire.py`: what goes out to an engine.

- `serialize_named_tensors`: the `/update_weights_from_tensor` payload, base64 of a pickle of
  `[(name, tensor), ...]` (or a flattened bucket dict) with `ForkingPickler`'s reductions, as
  SGLang's `MultiprocessingSerializer` writes it (SGLang's metadata class name, devices by UUID). CPU tensors travel through shared memory (file-system
  strategy, so unrelated processes can open them; file descriptors cannot cross unrelated
  processes) and must stay alive until the call returns. With the payload come the names of the
  shared-memory segments it refers to, which the request announces (`shm_names`): the local engine
  maps no other segment.
- `flatten_tensors`: tensors' bytes back to back in one uint8 buffer (the "flattened_bucket").
- `tensor_specs` / `broadcast_named_tensors`: rank 0's half of `/update_weights_from_distributed`.
"""

from __future__ import annotations

import base64
import copyreg
import io
import pickle
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.models.shard_peers import file_system_sharing
from megatron_rl.rollout.wire import SGLANG_METADATA_CLASS, FlattenedTensorMetadata, cuda_device_uuid
from megatron_rl.weight_sync.rendezvous import in_daemon_thread


class _SGLangPickler(pickle._Pickler):
    """`ForkingPickler`'s reductions (shared memory, CUDA IPC) in the form SGLang reads back:
    `FlattenedTensorMetadata` under SGLang's module name (so no SGLang import is needed here), and a
    CUDA tensor's device named by UUID, as SGLang's `patch_torch` does, so that an engine process
    with another CUDA_VISIBLE_DEVICES opens the right GPU. The pure-Python pickler, because only it
    lets a class be written under another name; a payload is a few handles, never the weights."""

    def __init__(self, file: io.BytesIO) -> None:
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing.reductions  # noqa: F401  (registers the shared-memory reducers)

        super().__init__(file)
        self.shm_names: list[str] = []
        extra = {cls: self._recording(reduce) for cls, reduce in ForkingPickler._extra_reducers.items()}
        self.dispatch_table = {**copyreg.dispatch_table, **extra}
        self.dispatch_table[torch.Tensor] = _reduce_tensor
        self.dispatch_table[torch.nn.Parameter] = _reduce_tensor

    def _recording(self, reduce: Any) -> Any:
        """`reduce`, noting the name of every shared-memory segment it hands out."""
        from torch.multiprocessing import reductions

        def reduce_and_note(obj: Any) -> Any:
            rebuild, args = reduce(obj)
            if rebuild is reductions.rebuild_storage_filename:
                name = args[2].decode() if isinstance(args[2], bytes) else str(args[2])  # (cls, manager, name, size)
                if name not in self.shm_names:
                    self.shm_names.append(name)
            return rebuild, args

        return reduce_and_note

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if obj is FlattenedTensorMetadata:
            module, qualname = SGLANG_METADATA_CLASS
            self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())
            self.memoize(obj)
            return
        super().save_global(obj, name)


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple]:
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[6], int):
        args = (*args[:6], cuda_device_uuid(args[6]), *args[7:])  # arg 6: the storage device
    return rebuild, args


def serialize_named_tensors(obj: Any) -> tuple[str, list[str]]:
    """Base64 pickle of `obj` (a list of (name, tensor) or a flattened bucket dict) as SGLang's
    `MultiprocessingSerializer` writes it (see `_SGLangPickler`), and the names of the shared-memory
    segments it refers to (what the request announces as `shm_names`)."""
    buf = io.BytesIO()
    with file_system_sharing():
        pickler = _SGLangPickler(buf)
        pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii"), pickler.shm_names


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
    if flattened:
        flat, _ = flatten_tensors(named)
        buffers = [flat]
    else:
        buffers = [t.detach().contiguous() for _, t in named]
    # Issued on a thread of its own: NCCL builds a group's communicator at its first collective, and
    # that call blocks until every engine rank joins, which a refusing engine never does.
    issued = in_daemon_thread(lambda: [dist.broadcast(b, src=0, group=group, async_op=True) for b in buffers])
    deadline = time.monotonic() + timeout_s
    while not (issued.done() and all(w.is_completed() for w in issued.result())):
        if reply is not None and reply.done() and reply.exception() is not None:
            raise RuntimeError(
                f"the engine refused the update before receiving it ({reply.exception()}); "
                "the weight-update group is now out of step: destroy and re-create it"
            ) from reply.exception()
        if time.monotonic() > deadline:
            stage = "did not finish" if issued.done() else "did not start (the engines never joined it)"
            raise TimeoutError(f"broadcast of {len(named)} tensors {stage} within {timeout_s:.0f} s")
        time.sleep(poll_s)
    for work in issued.result():
        work.wait()
    return sum(b.numel() * b.element_size() for b in buffers)
