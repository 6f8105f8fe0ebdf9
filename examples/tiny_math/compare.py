"""Run every objective from the same warm start with the same seed and plot held-out accuracy vs RL time.

    python examples/tiny_math/compare.py                        # after run.sh (or prepare + sft)
    python examples/tiny_math/compare.py --objectives dapo gspo --out runs/tiny_math/compare -- train.steps=30

Each objective is one `megatron-rl train examples/tiny_math/rl.yaml algorithm.name=NAME` on 2 ranks
(EP=2) into OUT/NAME, plus the objective's settings in `OBJECTIVE_OVERRIDES`. The x axis is RL wall
time: the sum of `time/step` (rollout, rewards, old log-probs, updates, weight sync) up to each
evaluation, so evaluation and start-up are left out. Writes OUT/compare.png and OUT/summary.json,
and prints a Markdown table (warm start, final and best greedy accuracy, seconds to +40 points).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OBJECTIVES = ("grpo", "dapo", "gspo", "gspo_token", "sapo")
# Deviations from rl.yaml per objective (documented in docs/benchmarks.md): none beyond the presets.
OBJECTIVE_OVERRIDES: dict[str, list[str]] = {name: [] for name in OBJECTIVES}
GAIN = 0.40  # the accuracy gain (absolute) each objective must reach


def cpu_env(path: Path = HERE / "cpu.env") -> dict[str, str]:
    """The `export KEY=VALUE` lines of cpu.env (run.sh sources it): the same CPU kernels on every machine."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))


def train_command(
    name: str,
    run_dir: Path,
    overrides: list[str],
    nproc: int,
    config: Path = HERE / "rl.yaml",
    settings: list[str] | None = None,
) -> list[str]:
    """The torchrun command of one run: `config` with the run's `settings` (default: objective
    `name` and its `OBJECTIVE_OVERRIDES`), then `overrides`."""
    if settings is None:
        settings = [f"algorithm.name={name}", *OBJECTIVE_OVERRIDES[name]]
    cmd = [sys.executable, "-m", "megatron_rl.torchrun", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "megatron_rl.cli", "train", str(config), *settings]
    return cmd + [f"logging.run_dir={run_dir}", *overrides]


def accuracy_curve(records: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """(RL seconds, greedy held-out accuracy) at every evaluation; RL seconds sum `time/step` so far."""
    seconds, accuracy, elapsed = [], [], 0.0
    for record in records:
        elapsed += float(record.get("time/step", 0.0))
        if "eval/greedy_accuracy" in record:
            seconds.append(elapsed)
            accuracy.append(float(record["eval/greedy_accuracy"]))
    if not accuracy or seconds[0] != 0.0:
        raise ValueError("metrics.jsonl has no step-0 evaluation (set eval.every > 0)")
    return seconds, accuracy


def summarize(name: str, seconds: list[float], accuracy: list[float]) -> dict[str, Any]:
    start = accuracy[0]
    reached = next((s for s, a in zip(seconds, accuracy, strict=True) if a >= start + GAIN), None)
    return {
        "objective": name,
        "warm_start": start,
        "final": accuracy[-1],
        "best": max(accuracy),
        "rl_seconds": seconds[-1],
        f"seconds_to_plus_{round(GAIN * 100)}": reached,
        "seconds": seconds,
        "accuracy": accuracy,
    }


def plot(summaries: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s in summaries:
        ax.plot(s["seconds"], [100 * a for a in s["accuracy"]], marker="o", markersize=3, label=s["objective"])
    start = summaries[0]["warm_start"]
    ax.axhline(100 * start, color="grey", linestyle=":", label="warm start")
    ax.axhline(100 * (start + GAIN), color="grey", linestyle="--", label=f"warm start + {round(GAIN * 100)} points")
    ax.set_xlabel("RL wall time (s; evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(summaries: list[dict[str, Any]]) -> str:
    key = f"seconds_to_plus_{round(GAIN * 100)}"
    lines = [
        f"| objective | warm start | final | best | RL seconds | seconds to +{round(GAIN * 100)} |",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        reached = f"{s[key]:.0f}" if s[key] is not None else "not reached"
        lines.append(
            f"| {s['objective']} | {100 * s['warm_start']:.1f}% | {100 * s['final']:.1f}% | {100 * s['best']:.1f}% "
            f"| {s['rl_seconds']:.0f} | {reached} |"
        )
    return "\n".join(lines)


def compare_parser(doc: str, out: str, flag: str, names: tuple[str, ...] | list[str]) -> argparse.ArgumentParser:
    """The command line of a compare script (this one, tiny_tools'): `--out` (default `out`), the
    runs to make as `--FLAG` (any of `names`, default all), --nproc, --plot-only and the overrides."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(out), help="output folder")
    parser.add_argument(f"--{flag}", nargs="+", choices=list(names), default=list(names))
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (EP = 2 in rl.yaml)")
    parser.add_argument("--plot-only", action="store_true", help="redraw from the runs already in --out")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run (after --)")
    return parser


def compare_runs(
    names: list[str],
    out: Path,
    command: Callable[[str, Path], list[str]],
    title: str,
    plot_only: bool = False,
    kernels: dict[str, str] | None = None,
) -> int:
    """Train each run `name` with `command(name, OUT/name)` (unless `plot_only`; one thread, and the
    environment `kernels` when given), then write OUT/compare.png and OUT/summary.json and print the table."""
    sys.path.insert(0, str(REPO))
    from megatron_rl.metrics import read_metrics

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(kernels or {})}
    summaries = []
    for name in names:
        run_dir = out / name
        if not plot_only:
            print(f"== {name}: {run_dir}", flush=True)
            subprocess.run(command(name, run_dir), env=env, check=True)
        summaries.append(summarize(name, *accuracy_curve(read_metrics(run_dir))))
    plot(summaries, out / "compare.png", title)
    (out / "summary.json").write_text(json.dumps(summaries, indent=2) + "\n")
    print(table(summaries))
    print(f"plot: {out / 'compare.png'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = compare_parser(__doc__, "runs/tiny_math/compare", "objectives", OBJECTIVES).parse_args(argv)
    return compare_runs(
        args.objectives,
        args.out,
        lambda name, run_dir: train_command(name, run_dir, list(args.overrides), args.nproc),
        "tiny_math: held-out greedy accuracy from one warm start (seed 0, 2 ranks, EP=2)",
        args.plot_only,
        kernels=cpu_env(),
    )


if __name__ == "__main__":
    raise SystemExit(main())
