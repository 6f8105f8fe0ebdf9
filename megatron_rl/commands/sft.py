"""`megatron-rl sft CONFIG [key=value ...] [--resume | --resume-if-any | --force]`: the supervised stage (`megatron_rl.sft.stage`).

Run it as one process or under torchrun/srun (e.g. `torchrun --nproc-per-node 2 -m megatron_rl.cli sft
examples/tiny_math/sft.yaml` for EP = 2 on two CPU ranks).
"""

from __future__ import annotations

import argparse

from megatron_rl.commands.stage import add_stage_arguments, run_stage


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_stage_arguments(parser, example="train.steps=300")


def run(args: argparse.Namespace) -> int:
    from megatron_rl.sft.stage import run_sft

    return run_stage(args, "sft", lambda cfg, resume, force: run_sft(cfg, resume=resume, force=force))
