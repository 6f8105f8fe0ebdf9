"""Process groups and Megatron parallel state; CPU (gloo) support."""

from megatron_rl.parallel.launch import LaunchEnv, LaunchError, read_launch_env
from megatron_rl.parallel.layout import (
    ParallelLayout,
    check_layout,
    resolve_expert_tensor_parallel,
    resolve_sequence_parallel,
)
from megatron_rl.parallel.state import ParallelContext, destroy_distributed, init_distributed, resolve_backend

__all__ = [
    "LaunchEnv",
    "LaunchError",
    "ParallelContext",
    "ParallelLayout",
    "check_layout",
    "destroy_distributed",
    "init_distributed",
    "read_launch_env",
    "resolve_backend",
    "resolve_expert_tensor_parallel",
    "resolve_sequence_parallel",
]
