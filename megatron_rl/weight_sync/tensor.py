"""`rollout.weight_sync = tensor` (colocated): tensors by handle through `/update_weights_from_tensor`.

Rank 0 pauses generation (mode "abort"), then brings back released weights. It packs each
bucket into one reusable flattened buffer and posts the buffer's handle:
`{"flattened_tensor", "metadata"}` serialised as SGLang's `MultiprocessingSerializer` does,
repeated once per engine TP rank (`rollout.engine_gpus`), as SGLang's own `Engine` does. A CPU
buffer goes through shared memory, a GPU buffer as a CUDA IPC handle, so the engine must run on
the same machine. Each call returns only after the engine has copied the weights, and only then
is the buffer refilled. The new version and the cache flush go with the last bucket. Afterwards
rank 0 resumes the rest of the released memory and continues generation (also after an error).
With PP > 1 the other stages' buckets reach rank 0 first (`buckets.rank0_buckets`).
"""

from __future__ import annotations

from typing import Any

from megatron_rl.weight_sync.base import WeightSync
from megatron_rl.weight_sync.buckets import rank0_buckets, stage_senders
from megatron_rl.weight_sync.packing import Bucket, PackingBuffer, with_last
from megatron_rl.weight_sync.send import serialize_named_tensors


class TensorSync(WeightSync):
    mode = "tensor"
    needs_session = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.senders = stage_senders()
        self.engine_ranks = int(self.cfg.rollout.engine_gpus)
        self._buffer = PackingBuffer()

    def _prepare_engine(self) -> None:
        self._call(self.client.pause_generation("abort"), "POST /pause_generation")
        super()._prepare_engine()

    def _restore_engine(self) -> None:
        super()._restore_engine()
        self._call(self.client.continue_generation(), "POST /continue_generation")

    def _transfer(self, version: str) -> int:
        total = 0
        for bucket, last in with_last(rank0_buckets(self.chunks, self.model, self.senders, self.bucket_mb)):
            if self._error is None:
                total += self._send(bucket, version if last else None)
        return total

    def _send(self, bucket: Bucket, version: str | None) -> int:
        flat, meta = self._buffer.pack(bucket)
        payload = serialize_named_tensors({"flattened_tensor": flat, "metadata": meta})
        self._call(
            self.client.update_weights_from_tensor(
                [payload] * self.engine_ranks,
                load_format="flattened_bucket",
                weight_version=version,
                flush_cache=version is not None,
            ),
            f"POST /update_weights_from_tensor (bucket of {len(bucket)} tensors from {bucket[0][0]!r})",
        )
        return 0 if self._error is not None else sum(m.numel for m in meta)

    def close(self) -> None:
        self._buffer.close()
