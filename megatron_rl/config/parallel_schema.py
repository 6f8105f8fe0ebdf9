"""The `parallel` section: how the policy is split over the trainer's ranks (TP, PP and its stages' layers, EP,
expert-TP, CP, SP) and where its optimizer state lives (sharded over data parallelism, optionally on the host)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_rl.config.fields import described as _f


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "TP: ranks sharing every matrix", ge=1)
    pipeline_model_parallel_size: int = _f(1, "PP: pipeline stages", ge=1)
    num_layers_in_first_pipeline_stage: int | None = _f(
        None,
        "uneven PP: transformer layers of the first stage (it also holds the embedding); null = an even share; "
        "the stages between the first and the last split the rest evenly",
        ge=1,
    )
    num_layers_in_last_pipeline_stage: int | None = _f(
        None,
        "uneven PP: transformer layers of the last stage (it also holds the output layer); null = an even share",
        ge=1,
    )
    expert_model_parallel_size: int = _f(1, "EP: ranks sharing the experts", ge=1)
    expert_tensor_parallel_size: int | None = _f(None, "ETP: TP inside an expert; null = same as TP", ge=1)
    sequence_parallel: bool | None = _f(None, "sequence parallel; null = on whenever TP > 1")
    context_parallel_size: int = _f(
        1,
        "CP: ranks sharing every sequence, 2 x CP load-balanced chunks each (GPU or CPU); 1 = off",
        ge=1,
    )
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = _f(
        "p2p",
        "CP: how Transformer Engine's attention exchanges keys and values: p2p (a ring, overlapped with compute), "
        "all_gather, a2a (heads all-to-all; CP must divide the query groups); packed micro-batches "
        "(train.micro_batch_tokens) need p2p; without Transformer Engine (CPUs) the local attention all-gathers",
    )
    backend: Literal["auto", "nccl", "gloo"] = _f("auto", "torch.distributed backend; auto = nccl with CUDA, else gloo")
    use_distributed_optimizer: bool = _f(True, "shard the optimizer state over data-parallel ranks")
    overlap_grad_reduce: Literal["auto", True, False] = _f(
        "auto",
        "reduce each gradient bucket as soon as backward has filled it, overlapped with the rest of backward "
        "(Megatron's DDP); auto = on with NCCL; off with gloo: it runs there and gives the same update (checked "
        "at DP 2), but on a CPU's few cores the collective has no idle device to overlap with",
    )
    overlap_param_gather: Literal["auto", True, False] = _f(
        "auto",
        "with use_distributed_optimizer: gather the updated parameter shards bucket by bucket during the next "
        "forward instead of right after the optimizer step; auto = on with NCCL, off with gloo (as "
        "overlap_grad_reduce); the actor gathers them all at the end of each train call, before anything reads them",
    )
    optimizer_cpu_offload: bool = _f(
        False,
        "Adam's moments and update on the host (Megatron's HybridDeviceOptimizer): GPU memory for more of the "
        "model, the fp32 master shard stays on the GPU; needs CUDA, model.params_dtype bf16 or fp16 and "
        "use_distributed_optimizer",
    )
    optimizer_offload_fraction: float = _f(
        1.0, "with optimizer_cpu_offload: the share of the optimizer state (by parameters) on the host", gt=0, le=1
    )
