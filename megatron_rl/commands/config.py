"""`megatron-rl config`: validate a configuration as a stage would and print it resolved, or print the
reference of every key.

`--check train` (the default), `sft` or `convert` runs the stage's own validation
(`megatron_rl.validation.validate_run`: the command's needs, the model read from its config.json,
the parallel layout and the batch against the data-parallel size) on `--world-size` trainer ranks,
by default the smallest world the layout fits. What only the launch can know is left to it: the
device (`parallel.backend` is checked as if CUDA were there) and whether the local engine's
`rollout.port` is free. `--check none` checks only the configuration's own types, ranges and
combinations (what any `load_config` does).
"""

from __future__ import annotations

import argparse
import math
import sys

from megatron_rl.config import (
    Config,
    ConfigError,
    ParallelConfig,
    load_config,
    prompts_per_round,
    reference_rows,
    to_yaml,
)

CHECKS = ("train", "sft", "convert", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.name=dapo")
    parser.add_argument("--reference", action="store_true", help="print every key as a Markdown table")
    parser.add_argument(
        "--check",
        choices=CHECKS,
        default="train",
        help="the stage whose validation runs (default: train); none = the config's own rules only",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="trainer ranks the layout and the batch are checked against; default: the smallest world the layout fits",
    )


def smallest_world(parallel: ParallelConfig) -> int:
    """The fewest ranks a TP/PP/EP/ETP layout fits: a multiple of TP x PP and of ETP x EP x PP."""
    from megatron_rl.parallel.layout import resolve_expert_tensor_parallel

    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    etp, ep = resolve_expert_tensor_parallel(parallel), parallel.expert_model_parallel_size
    return math.lcm(tp * pp, etp * ep * pp)


def _checked(cfg: Config, check: str, world_size: int | None) -> tuple[Config, str]:
    """`cfg` resolved by `check`'s validation, and the comment saying what was validated."""
    if check == "none":
        return cfg, "# checked: types, ranges and combinations only (--check none)"
    from megatron_rl.validation import validate_run

    world = smallest_world(cfg.parallel) if world_size is None else world_size
    resolved = validate_run(cfg, check, world_size=world, cuda_available=True)  # type: ignore[arg-type]
    return resolved, (
        f"# validated for megatron-rl {check} on a world of {world} rank(s) (the device and rollout.port "
        "are checked at launch)"
    )


def run(args: argparse.Namespace) -> int:
    if args.reference:
        print("| key | type | default | meaning |\n|---|---|---|---|")
        for key, kind, default, help_text in reference_rows():
            print(f"| `{key}` | {kind} | `{default}` | {help_text} |")
        return 0
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:
        path, overrides = None, [path, *overrides]
    if args.world_size is not None and args.world_size < 1:
        print(f"config error: --world-size = {args.world_size}; allowed: >= 1", file=sys.stderr)
        return 2
    try:
        cfg, checked = _checked(load_config(path, overrides), args.check, args.world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    print(to_yaml(cfg), end="")
    print(checked)
    if cfg.train.epochs:
        per_step = cfg.train.prompts_per_step if args.check == "sft" else prompts_per_round(cfg)
        print(
            f"# train.steps: ceil({cfg.train.epochs} x the usable training prompts / {per_step} per step), derived "
            "once the data is read (the start-up prints it)"
        )
    return 0
