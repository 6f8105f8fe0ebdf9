"""`megatron-rl plot RUN_DIR [--out DIR]`: PNG curves of a run's metrics.jsonl (needs matplotlib)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder (logging.run_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="folder for the PNG files (default RUN_DIR/plots)")


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("megatron-rl plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 2
    from megatron_rl.metrics.plot import plot_run

    try:
        written = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"plot: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
