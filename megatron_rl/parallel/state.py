"""Start torch.distributed and Megatron's parallel_state from the launcher's variables and the config."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.parallel import cpu_compat
from megatron_rl.parallel.launch import LaunchEnv, read_launch_env, repick_port
from megatron_rl.parallel.layout import ParallelLayout, check_layout


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the job, returned by `init_distributed`."""

    rank: int
    local_rank: int
    backend: str
    device: torch.device
    layout: ParallelLayout

    @property
    def world_size(self) -> int:
        return self.layout.world_size


def resolve_backend(requested: str, cuda_available: bool | None = None) -> str:
    """`parallel.backend`: auto = nccl with CUDA, gloo without; nccl without CUDA is an error."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    if requested == "nccl" and not cuda:
        raise ConfigError("parallel.backend = 'nccl' needs CUDA; use 'gloo' or 'auto' on this machine")
    if requested not in ("nccl", "gloo"):
        raise ConfigError(f"parallel.backend = {requested!r}; allowed: ['auto', 'nccl', 'gloo']")
    return requested


def check_optimizer_offload(parallel: ParallelConfig, cuda_available: bool | None = None) -> None:
    """ConfigError for `parallel.optimizer_cpu_offload` without CUDA: Megatron's HybridDeviceOptimizer copies
    the state of GPU parameters to the host, and with the parameters on the host it fails at the first step."""
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if parallel.optimizer_cpu_offload and not cuda:
        raise ConfigError(
            "parallel.optimizer_cpu_offload = true needs CUDA (without it the optimizer state is on the host already)"
        )


def _megatron_sizes(layout: ParallelLayout) -> tuple[int, int, int, int, int]:
    return (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.expert_model_parallel_size,
        layout.expert_tensor_parallel_size,
        layout.context_parallel_size,
    )


def _current_megatron_sizes() -> tuple[int, int, int, int, int]:
    from megatron.core import parallel_state as ps

    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_context_parallel_world_size(),
    )


def join_world(backend: str, env: LaunchEnv, timeout: datetime.timedelta, tries: int = 3) -> None:
    """torch.distributed's process group at `env`'s rendezvous. A world of one whose port was taken between
    choosing and binding it (EADDRINUSE: another process on the machine) tries again on another free port."""
    for attempt in range(tries):
        try:
            dist.init_process_group(
                backend=backend,
                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
            return
        except dist.DistNetworkError as err:
            again = repick_port(env) if "EADDRINUSE" in str(err) and attempt + 1 < tries else None
            if again is None:
                raise
            env = again


def init_distributed(
    parallel: ParallelConfig,
    model: ModelConfig | None = None,
    *,
    seed: int = 1234,
    timeout_minutes: float = 30.0,
    env: LaunchEnv | None = None,
) -> ParallelContext:
    """torch.distributed (once per process), then Megatron's TP/PP/CP/EP/ETP/DP groups and RNG tracker.

    The layout is resolved and checked against the world size (and `model`, when given) before any
    group or model exists, as the entry points' `megatron_rl.validation.validate_run` did already; a
    bad layout raises ConfigError naming the keys. CPU support is applied when CUDA is absent. Call
    `destroy_distributed(process_group=False)` before a different layout.
    """
    env = env or read_launch_env()
    layout = check_layout(parallel, env.world_size, model)
    backend = resolve_backend(parallel.backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        cpu_compat.apply_cpu_compat()
        device = torch.device("cpu")
    cpu_compat.bind_missing_te_gemm()
    cpu_compat.unflag_missing_te_mla()

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    timeout = datetime.timedelta(minutes=timeout_minutes)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RuntimeError(
                f"torch.distributed is already running as rank {dist.get_rank()} of {dist.get_world_size()}, "
                f"not rank {env.rank} of {env.world_size}"
            )
    else:
        join_world(backend, env, timeout)
    if ps.model_parallel_is_initialized():
        if _current_megatron_sizes() != _megatron_sizes(layout):
            raise RuntimeError(
                f"Megatron parallel state already holds (TP, PP, EP, ETP, CP) = {_current_megatron_sizes()}, "
                f"not {_megatron_sizes(layout)}: call destroy_distributed(process_group=False) first"
            )
    else:
        tp, pp, ep, etp, cp = _megatron_sizes(layout)
        before = set(_process_groups())
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            distributed_timeout_minutes=max(1, int(timeout_minutes)),
        )
        _megatron_groups[:] = [group for group in _process_groups() if group not in before]
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return ParallelContext(rank=env.rank, local_rank=env.local_rank, backend=backend, device=device, layout=layout)


# The process groups `initialize_model_parallel` made. Megatron's destroy_model_parallel only forgets them:
# torch.distributed keeps each in its registry, a gloo group with its three threads, so a process that changes
# layout (convert, the tests' scenario launches) kept every earlier layout's groups and threads, and slowed down.
_megatron_groups: list[dist.ProcessGroup] = []


def _process_groups() -> list[dist.ProcessGroup]:
    """Every process group torch.distributed holds (its registry has no public reader)."""
    return list(dist.distributed_c10d._world.pg_map)


def destroy_distributed(process_group: bool = True) -> None:
    """Destroy Megatron's groups and forget the MoE router-replay registry; with `process_group`, stop
    torch.distributed."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplay

    RouterReplay.clear_global_router_replay_instances()
    ps.destroy_model_parallel()
    held = set(_process_groups())
    for group in _megatron_groups:
        if group in held:
            dist.destroy_process_group(group)
    _megatron_groups.clear()
    if process_group and dist.is_initialized():
        dist.destroy_process_group()
