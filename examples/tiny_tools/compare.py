"""GSPO-token with per-turn credit vs GSPO with outcome credit, from the same tiny_tools warm start.

    python examples/tiny_tools/compare.py                      # after run.sh (or prepare + sft)
    python examples/tiny_tools/compare.py --out runs/tiny_tools/compare -- train.steps=20

Each run is one `megatron-rl train examples/tiny_tools/rl.yaml` on 2 ranks (EP=2) into OUT/NAME with
the settings of `RUNS`, everything else (seed, data, environment, turn reward, lr, mini-batches)
shared. The curves, the table and the x axis (RL wall time: the sum of `time/step` up to each
evaluation) are tiny_math's compare.py's, imported. Writes OUT/compare.png and OUT/summary.json and
prints a Markdown table (warm start, final and best greedy accuracy, seconds to +40 points).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # examples.tiny_math.compare, megatron_rl

from examples.tiny_math.compare import compare_parser, compare_runs, train_command  # noqa: E402

# The two ways to credit a multi-turn trajectory (GSPO cannot take per-turn advantages: one ratio
# and one advantage per sequence; GSPO-token with outcome credit equals GSPO).
RUNS: dict[str, list[str]] = {
    "gspo_token_per_turn": ["algorithm.name=gspo_token", "algorithm.turn_credit=per_turn"],
    "gspo_outcome": ["algorithm.name=gspo", "algorithm.turn_credit=outcome"],
}


def main(argv: list[str] | None = None) -> int:
    args = compare_parser(__doc__, "runs/tiny_tools/compare", "runs", list(RUNS)).parse_args(argv)
    return compare_runs(
        args.runs,
        args.out,
        lambda name, run_dir: train_command(
            name, run_dir, list(args.overrides), args.nproc, HERE / "rl.yaml", RUNS[name]
        ),
        "tiny_tools: held-out greedy accuracy from one warm start (seed 0, 2 ranks, EP=2)",
        args.plot_only,
    )


if __name__ == "__main__":
    raise SystemExit(main())
