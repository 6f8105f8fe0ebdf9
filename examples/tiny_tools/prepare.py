"""Everything the tiny_tools example starts from, generated locally with fixed seeds (nothing downloaded).

OUT/data/train.jsonl    5,000 task rows (`a*b=`, DAPO-Math row format)
OUT/data/heldout.jsonl  500 held-out task rows, disjoint from train
OUT/data/sft.jsonl      warm-start rows: task rows plus "response", the trace's messages
                        (30% tool call, 15% tool call with its result ignored, 55% answer in the head)
OUT/model/              the randomly initialised tiny Qwen3-MoE of tiny_math with the tiny_tools tokenizer

Usage: python examples/tiny_tools/prepare.py --out runs/tiny_tools/assets [--seed 0] [--model-seed 0]
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # the repository root (examples.tiny_tools)
sys.path.insert(0, str(HERE.parent / "tiny_math"))  # tiny_math's model builder

from examples.tiny_math.prepare import prepare_main  # noqa: E402
from examples.tiny_tools.tools_task import add_task_arguments, write_from_args  # noqa: E402
from examples.tiny_tools.tools_tokenizer import build_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return prepare_main(__doc__, add_task_arguments, write_from_args, argv, tokenizer=build_tokenizer)


if __name__ == "__main__":
    raise SystemExit(main())
