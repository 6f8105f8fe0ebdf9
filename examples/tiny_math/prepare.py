"""Everything the tiny_math example starts from, generated locally with fixed seeds (nothing downloaded).

OUT/data/train.jsonl    5,772 task rows (DAPO-Math row format, bare-problem prompts)
OUT/data/heldout.jsonl  500 held-out task rows, disjoint from train
OUT/data/sft.jsonl      warm-start rows: task rows plus "response" (45% correct, 55% addition first)
OUT/model/              the randomly initialised tiny Qwen3-MoE policy and its character tokenizer

Usage: python examples/tiny_math/prepare.py --out runs/tiny_math/assets [--seed 0] [--model-seed 0]
       [--family qwen3_moe|deepseek_v3|glm4_moe|gpt_oss|deepseek_v32|qwen3_next|glm_moe_dsa|qwen3_5_moe|minimax_m2]
       (or FAMILY=...; default qwen3_moe)
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when run as a script

from tiny_model import FAMILIES, build_model  # noqa: E402
from tiny_task import add_task_arguments, write_from_args  # noqa: E402


def prepare_main(
    doc: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    write: Callable[[argparse.Namespace, Path], dict[str, Path]],
    argv: list[str] | None = None,
    tokenizer: Callable[[], Any] | None = None,
) -> int:
    """The command line of a prepare script (this one, tiny_tools'): the task's data into OUT/data
    by `write`, then the tiny model with `tokenizer()` (default: tiny_math's) into OUT/model."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--model-seed", type=int, default=0, help="model initialisation seed")
    parser.add_argument(
        "--family", default=os.environ.get("FAMILY") or "qwen3_moe", choices=FAMILIES, help="model family ($FAMILY)"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    paths = write(args, args.out / "data")
    tok = None if tokenizer is None else tokenizer()
    model = build_model(args.out / "model", args.model_seed, tokenizer=tok, family=args.family)
    for name, path in paths.items():
        print(f"{name}: {path}")
    print(f"model: {args.out / 'model'} ({sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return prepare_main(__doc__, add_task_arguments, write_from_args, argv)


if __name__ == "__main__":
    raise SystemExit(main())
