"""`megatron-rl train CONFIG [key=value ...] [--resume]`: the RL loop (`megatron_rl.trainer`).

Run it under torchrun/srun for several trainer ranks; started alone it runs as a world of one.
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_rl.config import ConfigError, load_config

HELP = "RL training: rollout, rewards, updates and weight sync (under torchrun for several ranks)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.name=dapo train.lr=1e-6")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in checkpoint.dir"
    )


def run(args: argparse.Namespace) -> int:
    from megatron_rl.parallel.launch import ensure_launch_env
    from megatron_rl.trainer import run_training
    from megatron_rl.validation import validate_run

    ensure_launch_env()
    try:
        cfg = validate_run(load_config(args.config, list(args.overrides)), "train")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_training(cfg, resume=args.resume)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0
