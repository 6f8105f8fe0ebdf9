"""What a run prints: progress, evaluations and real warnings, without the known-harmless noise.

`configure_console` runs once per process from `megatron_rl/cli.py:main`, so every subcommand,
every torchrun rank and the local engine child (`megatron_rl/rollout/local/launcher.py` starts it
through the same command) gets the same filters. Each filter below names what it hides and why
that is harmless. `megatron-rl --verbose ...` or `MEGATRON_RL_LOG_LEVEL=debug` installs none of
them and logs the package at DEBUG; `--verbose` sets the variable, so child processes follow.
Any other `MEGATRON_RL_LOG_LEVEL` sets the level of the package's loggers (`megatron_rl.*`).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

LOG_LEVEL_VARIABLE = "MEGATRON_RL_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class HarmlessWarning:
    """A `warnings.warn` to hide: its category, a regex matched at the start of its message, a regex
    matched at the start of the issuing module's name, and why it is harmless."""

    category: type[Warning]
    message: str
    module: str
    reason: str


@dataclass(frozen=True)
class HarmlessLogRecord:
    """A log record to drop: its logger's name, a regex matched at the start of its message, and why."""

    logger: str
    message: str
    reason: str

    def filter(self, record: logging.LogRecord) -> bool:
        """The `logging.Filter` protocol: False drops the record."""
        return re.match(self.message, record.getMessage()) is None


HARMLESS_WARNINGS: tuple[HarmlessWarning, ...] = (
    HarmlessWarning(
        UserWarning,
        r"(Transformer Engine and )?Apex (is|are) not installed\. Falling back to",
        r"megatron\.core\.",
        "Megatron announces at import that it uses its plain-torch kernels; without Transformer Engine "
        "(always on CPU) the package builds the local layer specs on purpose",
    ),
    HarmlessWarning(
        UserWarning,
        r"full scope is deprecated\. Use empty cuda_graph_scope",
        r"megatron\.core\.transformer\.transformer_config",
        "Megatron's own default `cuda_graph_scope='full'` warns in every TransformerConfig; the package "
        "captures no CUDA graphs",
    ),
    HarmlessWarning(
        FutureWarning,
        r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        r"torch\.distributed\.",
        "Megatron's DDP and distributed optimizer call the collectives by their old names; the "
        "collectives themselves are unchanged",
    ),
    HarmlessWarning(
        FutureWarning,
        r"`load_state_dict` is deprecated and will be removed in future versions\. Please use `load` instead",
        r"megatron_rl\.models\.torch_dist_io|megatron\.core\.dist_checkpointing\.",
        "reading a Megatron checkpoint (`checkpoint.load`, `--resume`, a reference or critic checkpoint) calls "
        "torch.distributed.checkpoint's `load_state_dict` with Megatron's load planner, as Megatron-Core's "
        "torch_dist strategy does; the read itself is unchanged",
    ),
    HarmlessWarning(
        FutureWarning,
        r"Please use DTensor instead and we are deprecating ShardedTensor",
        r"megatron_rl\.|megatron\.core\.|torch\.distributed\.",
        "Megatron's torch_dist checkpoints are read and written through torch's ShardedTensor (as "
        "Megatron-Core does); torch deprecates the class, not the checkpoint format",
    ),
    HarmlessWarning(
        UserWarning,
        r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
        r"megatron\.core\.optimizer\.|megatron_rl\.parallel\.cpu_compat",
        "the distributed optimizer's zero_grad (megatron.core.optimizer `_zero_grad_group_helper`) "
        "checks `.grad` of its parameter-shard views; on CPU every torch call passes through the "
        "cpu_compat torch-function mode, which the warning then names",
    ),
)

HARMLESS_LOG_RECORDS: tuple[HarmlessLogRecord, ...] = (
    HarmlessLogRecord(
        "megatron.core.rerun_state_machine",
        r"Implicit initialization of Rerun State Machine!|RerunStateMachine initialized in mode RerunMode\.DISABLED",
        "Megatron's rerun state machine (re-running steps to find faulty hardware) is not used: it starts "
        "itself, disabled, at the first training step and says so as a WARNING",
    ),
)


def log_level(environ: Mapping[str, str] | None = None) -> str | None:
    """`MEGATRON_RL_LOG_LEVEL` in lower case (None when unset); ValueError for a level not in LOG_LEVELS."""
    value = (os.environ if environ is None else environ).get(LOG_LEVEL_VARIABLE)
    if value is None or not value.strip():
        return None
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL_VARIABLE} = {value!r}; allowed: {list(LOG_LEVELS)}")
    return level


def configure_console(verbose: bool = False) -> None:
    """Install the filters above and the package's log level (see the module docstring); idempotent."""
    if verbose:
        os.environ[LOG_LEVEL_VARIABLE] = "debug"
    level = log_level()
    if level is not None:
        logging.getLogger("megatron_rl").setLevel(level.upper())
    if level == "debug":
        return
    for entry in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=entry.message, category=entry.category, module=entry.module)
    for record in HARMLESS_LOG_RECORDS:
        logging.getLogger(record.logger).addFilter(record)
