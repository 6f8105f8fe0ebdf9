"""The `megatron-rl` command: one subcommand per module, imported only when used.

Every process of a run starts here (each torchrun rank, the local engine child), so the console
filters of `megatron_rl/console.py` are installed here, before the subcommand's module is imported.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import sys

from megatron_rl import __version__
from megatron_rl.console import configure_console

# subcommand -> (module exposing `add_arguments(parser)` and `run(args) -> int`, its one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "config": (
        "megatron_rl.commands.config",
        "validate a config as train (or --check sft/convert) would, and print it resolved; or --reference",
    ),
    "serve": (
        "megatron_rl.rollout.local.serve",
        "serve a Hugging Face model over SGLang's HTTP API (the local rollout engine)",
    ),
    "convert": (
        "megatron_rl.commands.convert",
        "convert checkpoints: hf-to-megatron (HF folder -> Megatron distributed checkpoint) or megatron-to-hf",
    ),
    "train": (
        "megatron_rl.commands.train",
        "RL training: rollout, rewards, updates and weight sync (several ranks: under python -m megatron_rl.torchrun)",
    ),
    "plot": (
        "megatron_rl.commands.plot",
        "draw PNG curves (reward, accuracy, entropy, clip fraction, length, KL, stage times) of a run",
    ),
    "sft": (
        "megatron_rl.commands.sft",
        "supervised fine-tuning on response tokens (warm start); writes RUN_DIR/hf for the RL stage",
    ),
    "reward-server": (
        "megatron_rl.rewards.server",
        "serve a reward function (a built-in rule or module:function) over HTTP for reward.type=remote",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megatron-rl", description="RL post-training for MoE language models")
    parser.add_argument("--version", action="version", version=f"megatron-rl {__version__}")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show every warning and debug log (= MEGATRON_RL_LOG_LEVEL=debug, passed on to child processes)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    name = next((a for a in argv if not a.startswith("-")), None)
    global_options = argv[: argv.index(name)] if name is not None else argv
    try:
        configure_console(verbose="--verbose" in global_options)
    except ValueError as err:
        print(f"megatron-rl: {err}", file=sys.stderr)
        return 2
    try:
        for command, (module_name, summary) in COMMANDS.items():
            parser_of_command = sub.add_parser(command, help=summary, description=summary)
            if command == name:  # only the command run imports its module (torch, Megatron: seconds)
                importlib.import_module(module_name).add_arguments(parser_of_command)
        args, extra = parser.parse_known_args(argv)
        late = [a for a in extra if not a.startswith("-")]
        if late != extra or (late and not isinstance(getattr(args, "overrides", None), list)):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        if late:  # key=value overrides after a flag (`train CONFIG --resume train.steps=3`): argparse stops at the flag
            args.overrides += late
        if args.command is None:
            parser.print_help()
            return 2
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before the command handles it (its imports take seconds): no traceback
        return 130


def pace_garbage_collector() -> None:
    """Garbage collection for a process that imports torch, Megatron and transformers (each rank and
    engine of a run: `entry`)."""
    # Those imports make millions of long-lived objects, and the collector's default pace (a young
    # collection every 700 allocations, promoting into ever larger full scans) spends about 0.5 s of
    # a rank's start on them: collect young objects 14x less often.
    gc.set_threshold(10_000, 10, 10)
    # At exit the interpreter's collections walk that heap again (about 1 s of CPU a process, after
    # the work has ended); nothing needs collecting then, and atexit handlers still run.
    atexit.register(gc.freeze)


def entry() -> None:
    """The process's entry (the `megatron-rl` script, `python -m megatron_rl.cli`): `main`, then exit
    with its code."""
    pace_garbage_collector()
    sys.exit(main())


if __name__ == "__main__":
    entry()
