"""`megatron-rl train CONFIG [key=value ...] [--resume | --resume-if-any | --force]`: the RL loop (`megatron_rl.trainer`).

Run it under torchrun/srun for several trainer ranks; started alone it runs as a world of one.
"""

from __future__ import annotations

import argparse

from megatron_rl.commands.stage import add_stage_arguments, run_stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, example="algorithm.name=dapo train.lr=1e-6")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.trainer import RUN_ERRORS, run_training

    return run_stage(
        args,
        "train",
        lambda cfg, resume, force: run_training(cfg, resume=resume, force=force),
        run_errors=RUN_ERRORS,
    )
