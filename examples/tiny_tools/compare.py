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

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # examples.tiny_math.compare, megatron_rl

from examples.tiny_math.compare import accuracy_curve, plot, summarize, table, train_command  # noqa: E402

# The two ways to credit a multi-turn trajectory (GSPO cannot take per-turn advantages: one ratio
# and one advantage per sequence; GSPO-token with outcome credit equals GSPO).
RUNS: dict[str, list[str]] = {
    "gspo_token_per_turn": ["algorithm.name=gspo_token", "algorithm.turn_credit=per_turn"],
    "gspo_outcome": ["algorithm.name=gspo", "algorithm.turn_credit=outcome"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tiny_tools/compare"), help="output folder")
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (EP = 2 in rl.yaml)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from the runs already in --out")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (after --)")
    args = parser.parse_args(argv)
    from megatron_rl.metrics import read_metrics

    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    summaries = []
    for name in args.runs:
        run_dir = args.out / name
        if not args.plot_only:
            print(f"== {name}: {run_dir}", flush=True)
            cmd = train_command(name, run_dir, list(args.overrides), args.nproc, HERE / "rl.yaml", RUNS[name])
            subprocess.run(cmd, env=env, check=True)
        summaries.append(summarize(name, *accuracy_curve(read_metrics(run_dir))))
    title = "tiny_tools: held-out greedy accuracy from one warm start (seed 0, 2 ranks, EP=2)"
    plot(summaries, args.out / "compare.png", title)
    (args.out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    print(table(summaries))
    print(f"plot: {args.out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
