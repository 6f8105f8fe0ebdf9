"""What `megatron-rl train` and `megatron-rl sft` share: their arguments and one error line for a bad config, bad data or a checkpoint that does not fit (the
traceback too with `megatron-rl --verbose`), or for a stage's own run errors raised on every rank
alike (printed by rank 0 only). Ctrl-C (SIGINT) ends the stage at once, with one line on rank 0 and
exit code 130 on every rank, without a traceback; nothing is saved (SIGTERM/SIGUSR1 stop with a
checkpoint: `megatron_rl.parallel.signals`). Whatever error a rank ends with after SIGINT (a collective
whose peer already stopped, a checkpoint save the interruption cut short: its staging folder is left,
ignored by `--resume`) is reported as the interruption."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megatron_rl.config import Config, ConfigError, load_config
from megatron_rl.parallel.launch import LaunchError, read_launch_env
from megatron_rl.validation import Command

if TYPE_CHECKING:
    from megatron_rl.run_folder import ResumeMode


def add_stage_arguments(parser: argparse.ArgumentParser, *, example: str) -> None:
    """CONFIG, key=value overrides (`example` shows one), --resume, --resume-if-any and --force."""
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help=f"key=value overrides (before or after the flags), e.g. {example}")
    start = parser.add_mutually_exclusive_group()
    start.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in checkpoint.dir (refused when there is none)",
    )
    start.add_argument(
        "--resume-if-any",
        action="store_true",
        help="as --resume, but a logging.run_dir that holds no run starts afresh (a first Slurm job)",
    )
    start.add_argument(
        "--force",
        action="store_true",
        help="start afresh in a logging.run_dir that holds a run: the old one is moved to RUN_DIR.old-N (not deleted)",
    )


def _error(prefix: str, err: BaseException, verbose: bool, *, here: bool = True) -> int:
    """Exit code 2, with one line (and the traceback with --verbose) when `here`."""
    if here:
        if verbose:
            traceback.print_exception(err, file=sys.stderr)
        print(f"{prefix}{err}", file=sys.stderr)
    return 2


def _config_error(err: ConfigError, verbose: bool, command: Command) -> int:
    """A config error from the first rank of each node only: every rank of a node checks the same config
    and files alike (a line per rank would repeat it), another node may see other files. A world size the
    layout does not fit gets the launch it needs."""
    from megatron_rl.parallel.layout import LayoutError

    if isinstance(err, LayoutError) and err.world_sizes is not None:
        err = ConfigError(
            f"{err}; launch a multiple of {err.world_sizes} ranks, e.g. `python -m megatron_rl.torchrun "
            f"--standalone --nproc-per-node {err.world_sizes} -m megatron_rl.cli {command} CONFIG`"
        )
    return _error("config error: ", err, verbose, here=os.environ.get("LOCAL_RANK", "0") == "0")


def _rank0() -> bool:
    """Whether this process prints a line every rank would: global rank 0 (or one not launched yet)."""
    try:
        return read_launch_env().rank == 0
    except LaunchError:
        return True


def run_stage(
    args: argparse.Namespace,
    command: Command,
    run: Callable[[Config, ResumeMode, bool], Any],
    *,
    run_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Load the config, then `run(cfg, resume, force)` (a world of one unless launched by torchrun/srun),
    which validates it and tears down what it started (`megatron_rl.stage.Stage.launch`); exit code 2
    with one line on a config, data or conversion error or files (a checkpoint, the weight sync's) that
    could not be written, 1 with one line from rank 0 on one of `run_errors` or a run folder lost while
    running (raised on every rank alike), 130 on Ctrl-C."""
    try:
        return _run_stage(args, command, run, run_errors)
    except KeyboardInterrupt:
        if _rank0():
            print(f"{command}: interrupted (SIGINT): stopped at once, nothing saved", file=sys.stderr, flush=True)
        return 130


def _run_stage(
    args: argparse.Namespace,
    command: Command,
    run: Callable[[Config, ResumeMode, bool], Any],
    run_errors: tuple[type[Exception], ...],
) -> int:
    from megatron_rl.data import DataError
    from megatron_rl.models.hf_config import ConversionError
    from megatron_rl.models.write_errors import StorageWriteError
    from megatron_rl.parallel.launch import ensure_launch_env
    from megatron_rl.parallel.signals import interrupted, remember_stop_signals
    from megatron_rl.run_folder import RESUME_IF_ANY, RunFolderError

    verbose = bool(getattr(args, "verbose", False))
    remember_stop_signals()  # a SIGUSR1 during the slow start-up must not kill the process
    ensure_launch_env()
    try:
        cfg = load_config(args.config, list(args.overrides))
    except ConfigError as err:
        return _config_error(err, verbose, command)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    resume: ResumeMode = RESUME_IF_ANY if getattr(args, "resume_if_any", False) else args.resume
    try:
        try:
            run(cfg, resume, getattr(args, "force", False))
        except Exception:
            if interrupted():  # the error is the interruption's echo, not a failure of this rank
                raise KeyboardInterrupt from None
            raise
    except ConfigError as err:
        return _config_error(err, verbose, command)
    except (DataError, ConversionError, StorageWriteError) as err:
        return _error(f"{command}: error: ", err, verbose)
    except (*run_errors, RunFolderError) as err:
        if _rank0():
            _error(f"{command}: error: ", err, verbose)
        return 1
    return 0
