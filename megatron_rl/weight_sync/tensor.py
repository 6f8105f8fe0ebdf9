"""`rollout.weight_sync = tensor` (colocated): tensors by handle through `/update_weights_from_tensor`.

The controller (rank 0) pauses generation (mode "abort", or "retract" for partial rollouts:
`base.InFlight`), brings back released weights and opens the weight-update session. Then every
export sender (`senders.py`: one per pipeline stage and, with EP, per expert-parallel rank) hands
over its own buckets: it packs each into a flattened buffer of its own (`packing.pack_bucket`; a new
one per bucket on a GPU, because SGLang answers once its copies are queued and a reused buffer could
be overwritten under them; one reused shared-memory buffer on the CPU, see `packing.PackBuffers`)
and posts `{"flattened_tensor", "metadata"}` serialised as SGLang's `MultiprocessingSerializer`
does, one serialisation per engine TP rank, as SGLang's own `Engine` does (each rank opens its own
handle; CUDA IPC counts references per serialisation). A CPU buffer goes through shared memory and
serves every rank. On a GPU, engine server i's TP rank k runs on GPU i * rollout.engine_gpus + k of
the node (slurm/jobplan.py places colocated engines so), and its payload is a copy of the bucket on
that GPU, named by UUID: each engine process opens memory of its own GPU only. Handles open only on
the machine that made them, so every sender must run on the engines' machine (rank 0's): checked
when the sync is made. The new version and the cache flush go with the controller's last bucket,
after every sender is done. Afterwards rank 0 closes the session, resumes the rest of the released
memory and continues generation (also after an error).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.weight_sync.base import WeightSyncError, all_outcomes
from megatron_rl.weight_sync.packing import Bucket, PackBuffers, pack_bucket
from megatron_rl.weight_sync.send import serialize_named_tensors
from megatron_rl.weight_sync.senders import FromSenders, Sender, params_device


def payload_devices(device: torch.device, servers: int, engine_gpus: int) -> list[list[torch.device]]:
    """Where each engine TP rank's copy of a bucket lives, by server: `device` for a CPU bucket (one
    shared-memory buffer serves every rank), else the GPU that TP rank runs on."""
    if device.type != "cuda":
        return [[device] * engine_gpus for _ in range(servers)]
    needed, visible = servers * engine_gpus, torch.cuda.device_count()
    if visible < needed:
        raise WeightSyncError(
            f"rollout.weight_sync = tensor: {servers} colocated server(s) x rollout.engine_gpus = {engine_gpus} run on "
            f"GPUs 0-{needed - 1} of this node, but this export sender sees {visible} GPU(s) (CUDA_VISIBLE_DEVICES): "
            "every sender must see every GPU of its node to hand each engine rank a buffer on its own GPU"
        )
    return [[torch.device("cuda", i * engine_gpus + k) for k in range(engine_gpus)] for i in range(servers)]


def rank_payloads(
    bucket: Bucket, devices: list[list[torch.device]], buffers: PackBuffers | None = None
) -> tuple[list[list[str]], list[str]]:
    """The serialised flattened bucket for each engine TP rank (by server): one buffer per device
    (`PackBuffers` says when one is reused), one serialisation per rank; and the shared-memory
    segments they refer to (the request's `shm_names`)."""
    flat, meta = pack_bucket(bucket, buffers)
    copies = {flat.device: flat}
    payloads, shm_names = [], []
    for server in devices:
        row = []
        for device in server:
            if device not in copies:
                copies[device] = flat.to(device)
            payload, names = serialize_named_tensors({"flattened_tensor": copies[device], "metadata": meta})
            row.append(payload)
            shm_names += [n for n in names if n not in shm_names]
        payloads.append(row)
    return payloads, shm_names


def off_engine_host(senders: list[Sender]) -> str | None:
    """Why the tensor mode cannot run with these senders (one on another machine than rank 0, where
    the colocated engines run), or None."""
    away = [s for s in senders if s.host != senders[0].host]
    if not away:
        return None
    s = away[0]
    return (
        f"rollout.weight_sync = tensor: the export sender of pipeline stage {s.stage}, EP rank {s.ep_rank} is global "
        f"rank {s.rank} on {s.host!r}, not on the engines' machine {senders[0].host!r} (rank 0's); tensor handles "
        "open only on the machine that made them: use rollout.weight_sync=distributed or disk across machines"
    )


class TensorSync(FromSenders):
    mode = "tensor"
    needs_session = True
    pauses_for_transfer = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine_ranks = int(self.cfg.rollout.engine_gpus)
        self._devices: list[list[torch.device]] = []
        self._buffers = PackBuffers()
        problem = off_engine_host(self.senders)
        if problem is None and self.is_sender:
            try:
                self._devices = payload_devices(params_device(self.chunks), len(self.client.urls), self.engine_ranks)
            except WeightSyncError as err:
                problem = str(err)
        problem = next((p for p in all_outcomes(problem) if p is not None), None)
        if problem is not None:
            super().close()
            raise WeightSyncError(problem)

    def _send(self, bucket: Bucket, version: str | None) -> int:
        payloads, shm_names = rank_payloads(bucket, self._devices, self._buffers)
        self._call(
            self.client.update_weights_from_tensor(
                payloads,
                shm_names=shm_names,
                load_format="flattened_bucket",
                weight_version=version,
                flush_cache=version is not None,
                abort_all_requests=self.in_flight.abort_all_requests,
            ),
            f"POST /update_weights_from_tensor (bucket of {len(bucket)} tensors from {bucket[0][0]!r})",
        )
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # frees earlier buckets' buffers the engines have released
        return 0 if self._error is not None else sum(t.numel() * t.element_size() for _, t in bucket)
