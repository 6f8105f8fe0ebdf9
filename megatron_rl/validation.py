"""The one validation of a run, `validate_run`: every entry point calls it before Megatron is imported or any model
is built (`megatron-rl train`, `sft`, `convert`, `megatron-rl config`, which checks a config as a stage would,
and the Slurm planner `slurm/jobplan.py`), so that a configuration that cannot run fails within seconds with one
`ConfigError` naming the key path and the allowed values.

It runs the configuration's own rules (`megatron_rl.config.check_rules`) on the configuration as it will run,
the model read from its checkpoint, among the checks that need more than the config: the command's needs, the
files, the model's widths, the launch's world size and the device. The checks, in order: docs/architecture.md,
"Configuration and validation". It reads config.json and the safetensors headers only, so it is cheap and
idempotent. A training stage is validated once per launch, by `megatron_rl.stage.Stage.launch` (which
`megatron-rl train` and `sft` call).
"""

from __future__ import annotations

import dataclasses
import errno
import socket
from pathlib import Path
from typing import Literal, get_args

from megatron_rl.config import Config, ConfigError, check_rules
from megatron_rl.envs.base import environment_class
from megatron_rl.metrics.trackers import missing_tracker_packages
from megatron_rl.models.attention_choice import check_attention_backend, transformer_engine_layers
from megatron_rl.models.experts_choice import check_grouped_experts, use_grouped_experts
from megatron_rl.models.lora_rank import check_lora_rank
from megatron_rl.models.lora_targets import (
    check_init_adapter,
    check_local_engine_adapters,
    check_lora_sync,
    check_target_modules,
    resolve_lora_sync,
)
from megatron_rl.models.recompute_choice import check_recompute
from megatron_rl.models.safetensors_io import SafetensorsFormatError, read_header
from megatron_rl.models.source import resolve_model
from megatron_rl.parallel.device import transformer_engine_available
from megatron_rl.parallel.launch import read_launch_env
from megatron_rl.parallel.layout import check_layout
from megatron_rl.parallel.state import check_optimizer_offload, resolve_backend
from megatron_rl.rewards import RewardConfigError, load_group_filter

Command = Literal["train", "sft", "convert"]


def _check_rl_loop_needs(cfg: Config) -> None:
    if not cfg.data.train_path:
        raise ConfigError("data.train_path: megatron-rl train needs the training prompts (.jsonl or .parquet)")
    if not cfg.model.hf_path and not cfg.checkpoint.load:
        raise ConfigError("model.hf_path or checkpoint.load: megatron-rl train needs a policy to start from")
    alg, ro = cfg.algorithm, cfg.rollout
    if alg.soft_overlong_punishment and alg.overlong_buffer_len > ro.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_buffer_len ({alg.overlong_buffer_len}) exceeds rollout.max_new_tokens "
            f"({ro.max_new_tokens}): the soft overlong penalty zone must fit in the response length"
        )
    if alg.old_logprob_source == "rollout" and alg.is_correction != "none":
        raise ConfigError(
            "algorithm.is_correction corrects pi_old / pi_rollout, which is 1 when "
            "algorithm.old_logprob_source = 'rollout'; use 'recompute' or set is_correction = 'none'"
        )
    if alg.routing_replay == "r2" and alg.old_logprob_source == "rollout":
        raise ConfigError(
            "algorithm.routing_replay = 'r2' replays the routing recorded while recomputing the old log-probs "
            "and needs algorithm.old_logprob_source = 'recompute'; with the engine's log-probs use "
            "routing_replay = 'r3' (the engine's routing)"
        )
    if alg.ref_path is not None and not Path(alg.ref_path).is_dir():
        raise ConfigError(
            f"algorithm.ref_path = {alg.ref_path!r} is not a folder (a Hugging Face folder or a Megatron checkpoint)"
        )
    if cfg.eval.every and not cfg.data.eval_path:
        raise ConfigError(f"eval.every = {cfg.eval.every} needs data.eval_path (the held-out prompts)")
    if ro.n_samples_per_prompt < 2:
        # verl's GRPO would use the raw reward as the advantage of a group of one; every objective
        # here is group-relative (advantage = reward - group mean), which is 0 for a group of one
        raise ConfigError(
            f"rollout.n_samples_per_prompt = {ro.n_samples_per_prompt}: algorithm.name = {alg.name!r} computes "
            "group-relative advantages, which are 0 for a group of one response (nothing to learn); set it >= 2"
        )
    if ro.temperature == 0:
        raise ConfigError(
            "rollout.temperature = 0: greedy rollouts give every response of a group the same tokens, so "
            "every advantage is 0; train with a temperature > 0 (greedy evaluation is eval.temperature = 0)"
        )
    environment_class(cfg.env)  # env.type: a built-in, or a module:Class that imports
    if alg.dynamic_sampling_filter:
        try:
            load_group_filter(alg.dynamic_sampling_filter)
        except RewardConfigError as err:
            raise ConfigError(str(err)) from err
    _check_rl_batch(cfg, 1)  # at once; against the real data-parallel size once the layout is known


def _check_rl_batch(cfg: Config, data_parallel_size: int) -> None:
    """The full batch of a step against the updates and the data-parallel ranks it is split over."""
    samples = cfg.train.prompts_per_step * cfg.rollout.n_samples_per_prompt
    updates = cfg.train.updates_per_step
    if samples < updates * data_parallel_size:
        raise ConfigError(
            f"the samples of a step (train.prompts_per_step x rollout.n_samples_per_prompt = {samples}) are fewer "
            f"than train.updates_per_step ({updates}) x the data-parallel size ({data_parallel_size}): every "
            "update needs one sample per data-parallel rank; raise train.prompts_per_step or lower "
            "train.updates_per_step"
        )


def _check_sft_needs(cfg: Config) -> None:
    if not cfg.data.train_path:
        raise ConfigError("data.train_path: megatron-rl sft needs the SFT rows (prompt + response) file")
    for key in ("train_path", "eval_path"):
        value = getattr(cfg.data, key)
        if value is not None and not isinstance(value, str):
            raise ConfigError(f"data.{key}: megatron-rl sft reads one file, not a list ({value!r})")
    if not cfg.model.hf_path and not cfg.checkpoint.load:
        raise ConfigError("model.hf_path or checkpoint.load: megatron-rl sft needs a model to start from")


def _check_stage_folders(cfg: Config, command: Command) -> None:
    """The run folder, the checkpoint folder and the RL loop's disk sync folder are folders (or can
    be made), not files; the chosen trackers' packages import."""
    folders = [("logging.run_dir", cfg.logging.run_dir), ("checkpoint.dir", cfg.checkpoint.dir)]
    if command == "train" and cfg.rollout.weight_sync == "disk":
        folders.append(("rollout.sync_dir", cfg.rollout.sync_dir))
    missing = missing_tracker_packages(list(cfg.logging.backends))
    if missing:
        raise ConfigError(
            f"logging.backends = {list(cfg.logging.backends)}: {', '.join(missing)} cannot be imported; "
            f"pip install {' '.join(missing)}, or leave it out of logging.backends"
        )
    for key, value in folders:
        if value is None:
            continue
        path = Path(value)
        blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            what = "is a file" if blocking == path else f"is under {blocking}, which is a file"
            raise ConfigError(f"{key} = {value!r} {what}; it must be a folder (created if missing)")


def _check_local_engine_port(cfg: Config) -> None:
    """The local engine's fixed `rollout.port` is free on `rollout.host` (asked on the rank that starts it)."""
    ro = cfg.rollout
    if ro.port is None or not ro.uses_local_engine:
        return
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the engine's server binds
        try:
            sock.bind((ro.host, ro.port))
        except OverflowError as err:
            raise ConfigError(f"rollout.port = {ro.port}: {err}") from None
        except OSError as err:
            why = "already in use" if err.errno == errno.EADDRINUSE else err.strerror
            raise ConfigError(
                f"rollout.port = {ro.port} on rollout.host = {ro.host!r}: {why}; choose another port, or "
                "rollout.port = null for a free one"
            ) from None


def _check_weight_files(cfg: Config) -> None:
    """The safetensors files of the HF folders the run reads: headers whole, files not truncated."""
    for key, value in (("model.hf_path", cfg.model.hf_path), ("algorithm.ref_path", cfg.algorithm.ref_path)):
        if not value or not Path(value).is_dir():
            continue
        for file in sorted(Path(value).glob("*.safetensors")):
            try:
                read_header(file)
            except SafetensorsFormatError as err:
                raise ConfigError(f"{key}: {err}") from None


def _with_trajectory_budget(cfg: Config) -> Config:
    """`cfg` with env.max_total_tokens the model's max_position_embeddings when null; a larger one is refused."""
    positions, budget = cfg.model.max_position_embeddings, cfg.env.max_total_tokens
    if budget is None:
        return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_total_tokens=positions))
    if budget > positions:
        raise ConfigError(
            f"env.max_total_tokens = {budget} exceeds the model's max_position_embeddings ({positions}): a "
            "trajectory cannot be longer than the model's positions; lower it or leave it null (= the positions)"
        )
    return cfg


def _check_command_needs(cfg: Config, command: Command) -> None:
    """What `command` needs beyond `config.check_rules` (convert needs only the model and the layout)."""
    if command == "train":
        _check_rl_loop_needs(cfg)
        _check_stage_folders(cfg, command)
    elif command == "sft":
        _check_sft_needs(cfg)
        _check_stage_folders(cfg, command)
    elif command != "convert":
        raise ValueError(f"command {command!r}; allowed: {list(get_args(Command))}")


def validate_run(
    cfg: Config, command: Command, *, world_size: int | None = None, cuda_available: bool | None = None
) -> Config:
    """`cfg` with `model` read from the policy's config.json, once every check passed (in the module doc's order).

    `world_size`: the trainer ranks the layout must fit, None = WORLD_SIZE (or SLURM_NTASKS) of this
    launch. `cuda_available`: whether the trainer has CUDA (for `parallel.backend`), None = this
    machine's answer. Raises ConfigError naming the key path and the allowed values.
    """
    _check_command_needs(cfg, command)
    if command == "train" and world_size is None and read_launch_env().rank == 0:
        _check_local_engine_port(cfg)  # this launch's rank 0 starts the local engine
    resolved = resolve_model(cfg)
    _check_weight_files(resolved)
    check_rules(resolved)
    if resolved.model.lora.rank > 0:
        check_target_modules(resolved.model)
        if command == "train":
            resolved = resolve_lora_sync(resolved)
        check_lora_sync(resolved)
        check_lora_rank(resolved.model)
        check_init_adapter(resolved.model)
        if command == "train" and resolved.rollout.lora_sync == "adapter" and resolved.rollout.uses_local_engine:
            check_local_engine_adapters(resolved.model)
    if command != "convert":
        resolved = _with_trajectory_budget(resolved)
    transformer_engine = transformer_engine_layers(
        resolved.model, available=transformer_engine_available() if cuda_available is None else cuda_available
    )
    check_grouped_experts(resolved.model, resolved.parallel, transformer_engine=transformer_engine)
    check_attention_backend(resolved.model, resolved.parallel, transformer_engine=transformer_engine)
    te_grouped = transformer_engine and use_grouped_experts(resolved.model, resolved.parallel, transformer_engine=True)
    check_recompute(resolved.model, transformer_engine=transformer_engine, te_grouped_experts=te_grouped)
    world = read_launch_env().world_size if world_size is None else world_size
    layout = check_layout(resolved.parallel, world, resolved.model)
    if command == "train":
        _check_rl_batch(resolved, layout.data_parallel_size)
    resolve_backend(resolved.parallel.backend, cuda_available)
    check_optimizer_offload(resolved.parallel, cuda_available)
    return resolved
