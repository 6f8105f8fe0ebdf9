"""`megatron-rl config`: print the resolved configuration, or the reference of every key."""

from __future__ import annotations

import argparse
import sys

from megatron_rl.config import ConfigError, load_config, reference_rows, to_yaml

HELP = "print the resolved config (defaults < preset < YAML < overrides), or --reference"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. algorithm.name=dapo")
    parser.add_argument("--reference", action="store_true", help="print every key as a Markdown table")


def run(args: argparse.Namespace) -> int:
    if args.reference:
        print("| key | type | default | meaning |\n|---|---|---|---|")
        for key, kind, default, help_text in reference_rows():
            print(f"| `{key}` | {kind} | `{default}` | {help_text} |")
        return 0
    path, overrides = args.config, list(args.overrides)
    if path is not None and "=" in path:
        path, overrides = None, [path, *overrides]
    try:
        print(to_yaml(load_config(path, overrides)), end="")
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0
