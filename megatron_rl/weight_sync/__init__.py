"""Weight sync: the actor's Megatron weights -> Hugging Face names -> the rollout engine.

Trainer code: it runs on every trainer rank, reads `parallel_state` and the actor's model chunks,
and calls the exporter (`megatron_rl/models/export.py`).

    sync = make_weight_sync(cfg, engine, actor)    # every trainer rank (collective)
    report = sync.sync(step)                        # every rank; the engine then serves version str(step)
    sync.release_engine_memory()                    # colocated, optional: after rollout, before training
    sync.close()                                    # every rank

`engine` is the `RolloutEngine` on global rank 0, the controller (pause, session, version). Other
ranks may pass None. Modes (`rollout.weight_sync`):

- `disk`: each export sender writes its safetensors into one of two folders of `rollout.sync_dir`
  (default `logging.run_dir/weights`), the one the engine does not serve, overwriting it in place;
  then `/update_weights_from_disk` (`disk.py`).
- `distributed`: each export sender broadcasts its buckets over its own group with every engine
  rank, built once (gloo on CPU, nccl on GPU; `distributed.py`).
- `tensor`: colocated; each export sender posts its buckets by shared-memory / CUDA-IPC handle
  through `/update_weights_from_tensor`, with generation paused (`tensor.py`).

The export senders are the first rank of each pipeline stage and, with EP, of each expert-parallel
rank, each with the tensors it holds (`senders.py`); in the distributed and tensor modes each talks
to the engines with a client of its own, so no weight byte goes through another trainer rank.
Distributed and tensor syncs run inside SGLang's weight-update session (0.5.21+; `base.py`).
Colocated memory (release at start-up, CUDA cache, optimizer offload): `memory.py`.

Every rank gets the same `SyncReport`, or the same `WeightSyncError`, and a refused update names
the tensor. The engine validates each request whole. So a refused disk update, or a refused first
bucket, leaves the old weights serving. After a later bucket is refused, the earlier buckets are
already loaded. The version stays the old one, because it only goes with the controller's last
bucket, sent once every sender has finished.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_rl.weight_sync.base import ResyncAtStepBoundary, SyncReport, WeightSync, WeightSyncError
from megatron_rl.weight_sync.disk import DiskSync
from megatron_rl.weight_sync.distributed import DistributedSync
from megatron_rl.weight_sync.tensor import TensorSync

if TYPE_CHECKING:
    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.config import Config
    from megatron_rl.rollout.engine import RolloutEngine

MODES: dict[str, type[WeightSync]] = {"disk": DiskSync, "distributed": DistributedSync, "tensor": TensorSync}

__all__ = ["MODES", "ResyncAtStepBoundary", "SyncReport", "WeightSync", "WeightSyncError", "make_weight_sync"]


def make_weight_sync(
    cfg: Config, engine: RolloutEngine | None, actor: MegatronActor, *, bucket_mb: float | None = None
) -> WeightSync:
    """The sync of `cfg.rollout.weight_sync` (collective); `bucket_mb` overrides `rollout.bucket_mb`."""
    mode = cfg.rollout.weight_sync
    if mode not in MODES:
        raise ValueError(f"rollout.weight_sync = {mode!r}; allowed: {sorted(MODES)}")
    if getattr(actor, "lora", None) is not None:  # LoRA: merged or adapter-only (weight_sync/lora.py)
        from megatron_rl.weight_sync.lora import make_lora_sync

        return make_lora_sync(cfg, engine, actor, bucket_mb=bucket_mb)
    return MODES[mode](cfg, engine, actor, bucket_mb=bucket_mb)
