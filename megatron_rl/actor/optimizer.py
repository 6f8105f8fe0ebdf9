"""Training state of the actor: DDP-wrapped model chunks, Megatron's (distributed) Adam, the LR schedule.

Gradient convention: the gradient is the SUM of the micro-batch gradients over all micro-batches
and DP ranks, as `megatron_rl.losses` requires (under CP each CP rank's gradient is its positions'
share of it). Megatron scales it twice on the way, with `calculate_per_token_loss` off: its
schedule multiplies a loss function's (loss, metrics) by CP / micro-batches
(`schedules.forward_step_calc_loss`, to undo the CP part of DDP's average), and its DDP divides by
DP x CP as it reduces the gradients over DP x CP. `loss_scale` is the one factor that undoes both.

LR schedule: Megatron's `OptimizerParamScheduler`, advanced as Megatron's own training loop does,
once after each APPLIED optimizer step (`apply_update`: not before the step, not on a step the
optimizer skipped), so update k (1-based, counting applied updates) runs at the schedule's value
after k - 1 of them: linear warm-up lr * k / W for k <= W = `config.warmup_steps` (`train.lr_warmup_steps`,
or `train.lr_warmup_ratio` of N), then
`train.lr_decay_style` from lr towards `train.min_lr`, which it reaches after the last update
(N = `train.steps x train.updates_per_step x train.ppo_epochs`): the last update runs at
min_lr + (lr - min_lr) / (N - max(W - 1, 0)) with linear decay, not at min_lr.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_model_config

from megatron_rl.config import ParallelConfig, TrainConfig, optimizer_steps, warmup_steps


@dataclass
class TrainingState:
    """What a train step changes: the wrapped model chunks, the optimizer, the schedule, the step count."""

    model: list[torch.nn.Module]
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    step: int = 0


def ddp_config(parallel: ParallelConfig, backend: str) -> DistributedDataParallelConfig:
    """Megatron's DDP config under the torch.distributed `backend`: fp32 gradient reduction, the NaN check, and
    `parallel.overlap_grad_reduce` / `overlap_param_gather` (auto: on with NCCL, the gather with the distributed
    optimizer only; off with gloo, see their help)."""
    nccl = backend == "nccl"
    grad, gather = parallel.overlap_grad_reduce, parallel.overlap_param_gather
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=grad is True or (grad == "auto" and nccl),
        overlap_param_gather=parallel.use_distributed_optimizer and (gather is True or (gather == "auto" and nccl)),
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        check_for_nan_in_grad=True,
        average_in_collective=False,
    )


def gather_updated_params(state: TrainingState) -> None:
    """Finish the parameter all-gather that `overlap_param_gather` defers to the next training forward, so that
    whatever reads the parameters next (log-probs, weight sync, export, checkpoints) sees the update."""
    for chunk in state.model:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def wrap_ddp(chunks: Sequence[torch.nn.Module], parallel: ParallelConfig) -> list[torch.nn.Module]:
    """Float16Module for bf16/fp16 chunks, then Megatron's DDP (`ddp_config`); installs the grad finalisation hooks."""
    config = get_model_config(chunks[0])
    ddp = ddp_config(parallel, torch.distributed.get_backend(ps.get_data_parallel_group()))
    wrapped = []
    for chunk in chunks:
        module = Float16Module(config, chunk) if (config.bf16 or config.fp16) else chunk
        wrapped.append(DistributedDataParallel(config=config, ddp_config=ddp, module=module))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = wrapped[0].no_sync if len(wrapped) == 1 else [m.no_sync for m in wrapped]
    return wrapped


def optimizer_config(train: TrainConfig, parallel: ParallelConfig, params_dtype: torch.dtype) -> OptimizerConfig:
    """Adam (decoupled weight decay) with the `train` section's hyper-parameters; with
    `parallel.optimizer_cpu_offload`, Megatron's HybridDeviceOptimizer keeps `optimizer_offload_fraction` of the
    state on the host and updates it there (torch's AdamW, the same update), the fp32 master shards staying on
    the GPU (Megatron's precision-aware optimizer, which moves them too, needs Transformer Engine)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=train.lr,
        min_lr=train.min_lr,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_beta1,
        adam_beta2=train.adam_beta2,
        adam_eps=train.adam_eps,
        clip_grad=train.grad_clip,
        bf16=params_dtype is torch.bfloat16,
        fp16=params_dtype is torch.float16,
        params_dtype=params_dtype,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
        optimizer_cpu_offload=parallel.optimizer_cpu_offload,
        optimizer_offload_fraction=parallel.optimizer_offload_fraction,
    )


def fuse_adam(optimizer: MegatronOptimizer) -> int:
    """Switch the torch Adam that Megatron falls back to without Transformer Engine or Apex (whose FusedAdam is
    fused already) to torch's fused kernel (one launch for all tensors; CUDA, also on the CPU in torch >= 2.4):
    the same update. The CPU offload's host optimizer is left as it is. Returns the parameter groups switched."""
    switched = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        adam = getattr(inner, "optimizer", None)
        if isinstance(adam, torch.optim.Adam):  # AdamW too
            for group in adam.param_groups:
                group["fused"], group["foreach"] = True, False
                switched += 1
    return switched


def lr_scheduler(optimizer: MegatronOptimizer, train: TrainConfig) -> OptimizerParamScheduler:
    """Megatron's scheduler over `config.optimizer_steps` (train.steps x updates_per_step x ppo_epochs; module doc).

    Its value after n applied updates is lr * (n + 1) / W during the warm-up (Megatron's warm-up of
    W - 1 steps from lr / W), then the decay, reaching min_lr at n = N.
    """
    total, warmup_updates = optimizer_steps(train), warmup_steps(train)  # checked by config.check_rules
    warmup = max(warmup_updates - 1, 0)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=train.lr / warmup_updates if warmup_updates > 0 else train.lr,
        max_lr=train.lr,
        min_lr=train.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total, warmup + 1),
        lr_decay_style=train.lr_decay_style,
        start_wd=train.weight_decay,
        end_wd=train.weight_decay,
        wd_incr_steps=max(total, 1),
        wd_incr_style="constant",
    )


def build_training_state(
    chunks: Sequence[torch.nn.Module], train: TrainConfig, parallel: ParallelConfig
) -> TrainingState:
    """DDP + optimizer (torch's fused Adam with CUDA, `fuse_adam`) + schedule around freshly built model chunks."""
    config = get_model_config(chunks[0])
    model = wrap_ddp(chunks, parallel)
    optimizer = get_megatron_optimizer(optimizer_config(train, parallel, config.params_dtype), model)
    if torch.cuda.is_available():
        fuse_adam(optimizer)
    return TrainingState(model=model, optimizer=optimizer, scheduler=lr_scheduler(optimizer, train))


def apply_update(state: TrainingState) -> tuple[bool, float | None, float]:
    """One optimizer step on the accumulated gradients, then the schedule advances if it was applied.

    Returns (applied, grad norm before clipping, the learning rate the step used). Megatron's
    optimizer skips a step (applied False) on non-finite gradients under loss scaling.
    """
    lr = float(state.optimizer.param_groups[0]["lr"])
    applied, grad_norm, _ = state.optimizer.step()
    if applied:
        state.scheduler.step(increment=1)
    state.step += 1
    return bool(applied), grad_norm, lr


def loss_scale(num_micro_batches: int) -> float:
    """Factor on each micro-batch loss that turns Megatron's averaging into the sum (see module doc):
    (micro-batches / CP) x (DP x CP) = micro-batches x DP, CP cancelling out."""
    return float(num_micro_batches * ps.get_data_parallel_world_size())
