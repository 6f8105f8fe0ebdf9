"""`megatron-rl sft CONFIG [key=value ...] [--resume]`: the supervised stage (see `megatron_rl.sft.stage`).

Run it as one process or under torchrun/srun (e.g. `torchrun --nproc-per-node 2 -m megatron_rl.cli sft
examples/tiny_math/sft.yaml` for EP = 2 on two CPU ranks).
"""

from __future__ import annotations

import argparse
import logging
import sys

from megatron_rl.config import ConfigError, load_config

HELP = "supervised fine-tuning on response tokens (warm start); writes RUN_DIR/hf for the RL stage"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=300")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the newest complete checkpoint in checkpoint.dir"
    )


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_rl.data import DataError
    from megatron_rl.models.hf_config import ConversionError
    from megatron_rl.parallel.launch import ensure_launch_env
    from megatron_rl.sft.stage import run_sft
    from megatron_rl.validation import validate_run

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    ensure_launch_env()  # a plain `megatron-rl sft` is a world of one
    try:
        cfg = validate_run(load_config(args.config, list(args.overrides)), "sft")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        run_sft(cfg, resume=args.resume)
    except (ConfigError, DataError, ConversionError) as err:
        print(f"sft: {err}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
