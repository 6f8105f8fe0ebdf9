"""Benchmark of one RL step of the reduced-size example: seconds per stage and the overhead share.

Runs `megatron-rl train examples/tiny_math/rl.yaml` (DAPO, 2 ranks with EP=2, the local engine)
from the example's warm start for --steps steps without evaluation, then reads RUN_DIR/metrics.jsonl.
A step's wall time is the time between the ends of two consecutive steps (`time/elapsed`), so the
loop's own bookkeeping (metrics, progress) is inside it; the first --warmup steps are left out.
Stages, from the trainer's metrics:

- generate: the engine producing the responses (all dynamic-sampling rounds), over HTTP;
- reward: decoding and scoring the responses;
- forward: the old log-probs (one forward pass of the actor over the batch);
- train: the updates (forward, backward, gradient all-reduce and optimizer step);
- sync: pushing the new weights to the engine (`rollout.weight_sync`);
- orchestration: everything else (batch assembly, broadcast of the batch to the ranks, the loop).

The figure of merit is the share of (sync + orchestration) in the step, goal <= 10%. Each JSON line
gives a stage's mean seconds next to the baseline measured in the same run, the mean step time, and
their ratio (the share). CPU load from other processes slows every stage; the shares are what compare.

    python tools/bench/rl_step.py [--policy runs/tiny_math/sft/hf] [--assets runs/tiny_math/assets] [--steps 12]
    python tools/bench/rl_step.py --batch-only --batch-tokens 2000000     # the batch distribution alone

Then (unless --batch-tokens 0) the step batch's distribution at a simulated R3 step of
--batch-tokens tokens on --batch-ranks gloo ranks (`batch_distribution.py`: Qwen3-30B-A3B's 48
layers x top-8 routing): bytes per receiving rank and seconds before (the whole `StepBatch` pickled
to every rank) and after (tensors, each DP rank its samples' routing as uint8), same run, ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STAGES = {
    "generate": "time/generate",
    "reward": "time/reward",
    "forward": "time/old_logprobs",
    "train": "time/train",
    "sync": "time/sync",
}
GOAL = 0.10


def stage_seconds(records: list[dict[str, Any]], warmup: int) -> list[dict[str, float]]:
    """Per measured step: each stage's seconds, `step` (wall time since the previous step's end) and
    `orchestration` (step minus every named stage)."""
    steps = [r for r in records if r.get("step", 0) > 0 and "time/elapsed" in r]
    out = []
    for previous, record in zip(steps, steps[1:], strict=False):
        if record["step"] <= warmup:
            continue
        row = {name: float(record.get(key, 0.0)) for name, key in STAGES.items()}
        # evaluation and checkpoints are not part of a step (the bench turns them off; subtracted if on)
        outside = float(record.get("time/eval", 0.0)) + float(record.get("time/checkpoint", 0.0))
        row["step"] = float(record["time/elapsed"]) - float(previous["time/elapsed"]) - outside
        row["orchestration"] = row["step"] - sum(row[name] for name in STAGES)
        out.append(row)
    if not out:
        raise ValueError(f"no measured step: need more than --warmup {warmup} + 1 steps with time/elapsed")
    return out


def figures(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    """One JSON-ready figure per stage, and the (sync + orchestration) share, against the mean step."""
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    step = mean["step"]
    lines = [
        {
            "figure": f"seconds/{name}",
            "value": mean[name],
            "baseline": "seconds/step",
            "baseline_value": step,
            "ratio": mean[name] / step,
            "steps": len(rows),
        }
        for name in (*STAGES, "orchestration")
    ]
    overhead = mean["sync"] + mean["orchestration"]
    lines.append(
        {
            "figure": "share/sync_plus_orchestration",
            "value": overhead,
            "baseline": "seconds/step",
            "baseline_value": step,
            "ratio": overhead / step,
            "goal": GOAL,
            "met": overhead / step <= GOAL,
            "steps": len(rows),
        }
    )
    return lines


def run_example(policy: Path, assets: Path, run_dir: Path, steps: int, overrides: list[str]) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "megatron_rl.cli", "train", str(REPO / "examples" / "tiny_math" / "rl.yaml")]
    cmd += [
        f"model.hf_path={policy}",
        f"data.train_path={assets / 'data' / 'train.jsonl'}",
        "data.eval_path=null",
        f"logging.run_dir={run_dir}",
        f"train.steps={steps}",
        "eval.every=0",
        "checkpoint.export_hf=false",
        "logging.progress=false",
        "logging.backends=[]",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = run_dir.with_suffix(".log")
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"megatron-rl train failed ({proc.returncode}); log: {log}")


def batch_distribution(tokens: int, ranks: int, tp: int) -> list[dict[str, Any]]:
    """The JSON lines of `batch_distribution.py` run under torchrun with `ranks` processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [str(REPO / "tools" / "bench" / "batch_distribution.py"), "--tokens", str(tokens), "--tp", str(tp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"batch_distribution.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", type=Path, default=REPO / "runs/tiny_math/sft/hf", help="warm-start HF folder")
    parser.add_argument("--assets", type=Path, default=REPO / "runs/tiny_math/assets", help="prepare.py output")
    parser.add_argument("--steps", type=int, default=12, help="RL steps to run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--run-dir", type=Path, default=None, help="keep the run here (default: a temp folder)")
    parser.add_argument("--batch-tokens", type=int, default=2_000_000, help="simulated R3 step (0: skip)")
    parser.add_argument("--batch-ranks", type=int, default=2, help="trainer ranks of the simulated step")
    parser.add_argument("--batch-tp", type=int, default=1, help="their tensor parallel size (the rest is DP)")
    parser.add_argument("--batch-only", action="store_true", help="only the batch distribution, no RL run")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of rl.yaml (after --)")
    args = parser.parse_args(argv)
    if args.batch_only:
        for line in batch_distribution(args.batch_tokens, args.batch_ranks, args.batch_tp):
            print(json.dumps(line))
        return 0
    for path, what in ((args.policy / "config.json", "--policy"), (args.assets / "data" / "train.jsonl", "--assets")):
        if not path.is_file():
            raise SystemExit(f"{what}: {path} is missing; run examples/tiny_math/run.sh (or prepare + sft) first")
    sys.path.insert(0, str(REPO))
    from megatron_rl.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="mrl-bench-rl-step-") as tmp:
        run_dir = args.run_dir or Path(tmp) / "run"
        run_example(args.policy, args.assets, run_dir, args.steps, list(args.overrides))
        for line in figures(stage_seconds(read_metrics(run_dir), args.warmup)):
            print(json.dumps(line))
    if args.batch_tokens > 0:
        for line in batch_distribution(args.batch_tokens, args.batch_ranks, args.batch_tp):
            print(json.dumps(line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
