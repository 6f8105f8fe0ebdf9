"""Launcher variables, layout checks and backend choice (no processes started)."""

from __future__ import annotations

import pytest

from megatron_rl.config import ConfigError, ModelConfig, ParallelConfig
from megatron_rl.parallel import LaunchError, check_layout, read_launch_env, resolve_backend

from mrl_configs import layout as _par

RDV = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}


def test_torchrun_variables() -> None:
    env = read_launch_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", **RDV})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (5, 8, 1, "torchrun")
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)


def test_slurm_variables_and_torchrun_precedence() -> None:
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "3", **RDV}
    env = read_launch_env(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (3, 4, 3, "slurm")
    env = read_launch_env({**slurm, "RANK": "0", "WORLD_SIZE": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.source) == (0, 1, 0, "torchrun")


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({}, "no launcher variables"),
        ({"RANK": "0", **RDV}, "WORLD_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "MASTER_ADDR is not set"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "h"}, "launched by slurm but MASTER_PORT"),
        ({"RANK": "x", "WORLD_SIZE": "2", **RDV}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", **RDV}, "RANK=2 is not a rank of WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, "not a TCP port"),
    ],
)
def test_launch_errors_name_the_variable(env: dict[str, str], needle: str) -> None:
    with pytest.raises(LaunchError, match=needle.replace("(", r"\(")):
        read_launch_env(env)


def test_layout_sizes() -> None:
    # 16 ranks, TP 2 x PP 2 -> DP 4; experts: ETP (= TP) 2 x EP 4 x PP 2 = 16 -> expert DP 1.
    lay = check_layout(_par(tp=2, pp=2, ep=4), 16, ModelConfig(num_layers=4, num_experts=8))
    assert (lay.data_parallel_size, lay.expert_tensor_parallel_size, lay.expert_data_parallel_size) == (4, 2, 1)
    assert lay.sequence_parallel
    lay = check_layout(_par(tp=2, ep=2, etp=1), 4)
    assert (lay.data_parallel_size, lay.expert_data_parallel_size, lay.sequence_parallel) == (2, 2, True)
    assert not check_layout(_par(), 1).sequence_parallel


@pytest.mark.parametrize(
    ("parallel", "world", "model", "needle"),
    [
        (
            _par(tp=2, pp=2),
            6,
            None,
            "world size 6 is not divisible by parallel.tensor_model_parallel_size (2) x "
            "parallel.pipeline_model_parallel_size (2)",
        ),
        (
            _par(ep=4),
            6,
            None,
            "world size 6 is not divisible by parallel.expert_tensor_parallel_size (1) x "
            "parallel.expert_model_parallel_size (4)",
        ),
        (_par(sp=True), 2, None, "parallel.sequence_parallel = true needs parallel.tensor_model_parallel_size > 1"),
        (
            _par(ep=3),
            3,
            ModelConfig(num_experts=8),
            "parallel.expert_model_parallel_size (3) must divide model.num_experts (8)",
        ),
        (
            _par(tp=4),
            4,
            ModelConfig(num_attention_heads=6, num_query_groups=2),
            "must divide model.num_attention_heads",
        ),
        (_par(tp=2), 2, ModelConfig(ffn_hidden_size=255), "must divide model.ffn_hidden_size (255)"),
        (
            _par(tp=2, etp=4),
            4,
            ModelConfig(moe_ffn_hidden_size=6),
            "parallel.expert_tensor_parallel_size (4) must divide model.moe_ffn_hidden_size (6)",
        ),
    ],
)
def test_bad_layouts_name_the_keys(
    parallel: ParallelConfig, world: int, model: ModelConfig | None, needle: str
) -> None:
    with pytest.raises(ConfigError) as err:
        check_layout(parallel, world, model)
    assert needle in str(err.value)


def test_backend_choice() -> None:
    assert resolve_backend("auto", cuda_available=True) == "nccl"
    assert resolve_backend("auto", cuda_available=False) == "gloo"
    assert resolve_backend("gloo", cuda_available=True) == "gloo"
    with pytest.raises(ConfigError, match="parallel.backend = 'nccl' needs CUDA"):
        resolve_backend("nccl", cuda_available=False)


def test_a_world_of_one_takes_another_port_when_its_own_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure_launch_env chooses a port free at that moment, which another process on the machine may bind before
    the rendezvous does (EADDRINUSE, seen on a shared machine): the world of one tries again on another free port,
    MASTER_PORT following; a launcher's port (torchrun's, Slurm's), which every rank agreed on, is never changed."""
    import datetime
    import os

    import torch.distributed as dist

    from megatron_rl.parallel import launch, state

    monkeypatch.setattr(os, "environ", {})
    monkeypatch.setattr(launch, "_picked_port", None)
    launch.ensure_launch_env()
    first = read_launch_env(os.environ)
    calls: list[str] = []

    def init_process_group(**kwargs: object) -> None:
        calls.append(str(kwargs["init_method"]))
        if len(calls) == 1:
            raise dist.DistNetworkError(f"failed to listen on any local network address. port: {first.master_port}, "
                                        "code: -98, name: EADDRINUSE, message: address already in use")  # fmt: skip

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    state.join_world("gloo", first, datetime.timedelta(seconds=5))
    assert calls == [f"tcp://127.0.0.1:{first.master_port}", f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"]
    assert os.environ["MASTER_PORT"] != str(first.master_port)

    calls.clear()
    torchrun = read_launch_env({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", **RDV})
    with pytest.raises(dist.DistNetworkError, match="EADDRINUSE"):
        state.join_world("gloo", torchrun, datetime.timedelta(seconds=5))
    assert calls == ["tcp://10.0.0.1:29500"]


def test_a_free_port_is_drawn_below_the_kernels_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel hands its ephemeral ports to every bind(0) and outgoing connection; a port chosen there was taken
    by another test's gloo connection before its rendezvous bound it (EADDRINUSE on CI's two workers). free_port
    draws below that range, a port it could bind; where none there is free, it takes the kernel's pick."""
    import socket
    from pathlib import Path

    from megatron_rl.parallel import launch

    range_file = Path("/proc/sys/net/ipv4/ip_local_port_range")
    lowest_ephemeral = int(range_file.read_text().split()[0]) if range_file.exists() else 32768
    ports = [launch.free_port() for _ in range(20)]
    assert all(10000 <= port < lowest_ephemeral for port in ports), ports
    assert len(set(ports)) > 1  # drawn, not one fixed port
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", ports[0]))  # free when returned
        listener.listen()
        monkeypatch.setattr(launch, "_LOWEST_DRAWN_PORT", ports[0])
        monkeypatch.setattr(launch, "_lowest_ephemeral_port", lambda: ports[0] + 1)  # the one port below is taken
        assert launch.free_port() >= lowest_ephemeral


def test_a_new_layout_in_the_same_process_leaves_no_group_of_the_old_one_behind() -> None:
    """A process that changes layout (convert; the layout scenarios, one process through dozens of layouts) destroys
    the groups Megatron made for the old one: torch.distributed had kept each (a gloo group holds three threads), so
    every earlier layout's groups and threads stayed, part of the 1,200 threads that slowed the layout launches."""
    import os

    import torch.distributed as dist

    from megatron_rl.parallel import destroy_distributed, init_distributed

    from mrl_configs import launch_of_one

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    with launch_of_one():
        init_distributed(_par())
        groups, before = len(dist.distributed_c10d._world.pg_map), threads()
        assert groups > 10  # Megatron's groups beside the world's
        for _ in range(3):
            destroy_distributed(process_group=False)
            assert len(dist.distributed_c10d._world.pg_map) == 1  # the world's group alone
            init_distributed(_par())
        assert len(dist.distributed_c10d._world.pg_map) == groups
        assert threads() <= before


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_an_actor_that_has_trained_is_freed_with_its_model_once_dropped(dispatcher: str) -> None:
    """Megatron's MoE token dispatchers kept their last forward's routing probabilities, whose autograd graph reaches
    the parameters' gradient accumulators and their DDP hooks, which hold the model: a cycle through autograd's C++
    nodes that Python's collector cannot see. A model that had trained outlived its actor, with its process groups'
    threads (48 more per actor scenario in the layout launches, each later scenario slower)."""
    import gc
    import weakref

    from megatron_rl.actor.actor import MegatronActor
    from megatron_rl.config import Config, RolloutConfig, TrainConfig, preset

    from mrl_configs import launch_of_one, seeded_batch, tiny_model

    cfg = Config(
        model=tiny_model("qwen3_moe", moe_token_dispatcher=dispatcher),
        parallel=_par(),
        rollout=RolloutConfig(temperature=1.0, max_new_tokens=16),
        algorithm=preset("grpo"),
        train=TrainConfig(steps=2, max_tokens_per_micro_batch=64, lr=1e-4, seed=3),
    )
    with launch_of_one():
        actor = MegatronActor(cfg)
        batch = seeded_batch(cfg.model.vocab_size, (12, 7), (5, 3))
        actor.train(batch.with_fields(old_log_probs=actor.compute_log_probs(batch).log_probs))
        model = weakref.ref(actor.chunks[0])
        actor.close()
        del actor
        gc.collect()
        assert model() is None, "the trained model is still alive after its actor was closed and dropped"
