"""Benchmark of the asynchronous loop (issue 12): sync against one_step_off and fully_async, same run.

The reduced-size example (tiny_math) with one trainer rank and one engine, each pinned to its own
core, so that generation and training can overlap on a 2-core machine. For every mode (`sync`,
`one_step_off`, `fully_async` with rollout.max_staleness 1 and 2) the bench starts the engine as its
own `megatron-rl serve` process under `taskset -c 1` (a fresh one: every mode starts from the same
weights) and runs `megatron-rl train examples/tiny_math/rl.yaml` under `taskset -c 0` against it
(`rollout.engine=sglang`, `rollout.sglang_urls`, `rollout.api_key`), one rank, --steps steps, the
held-out greedy evaluation before the first step and after the last, and without dynamic sampling
(one generation round per step, every group trained: a step is the same work in every mode). From RUN_DIR/metrics.jsonl:

- steps/s and trained tokens/s over the steps after --warmup (the wall time between the ends of two
  steps, evaluation and checkpoints left out; trained tokens = `throughput/train_tokens_per_s` x
  `time/train`, the tokens of the batch the updates ran on);
- held-out greedy accuracy (`eval/greedy_accuracy`) after the last step, and the trained samples
  that led there (the same in every mode: the same steps of the same batch size);
- idle shares over the step time: the trainer's (`time/wait_batch`) and the engine's
  (`time/engine_idle`); null where the loop does not record them.

One JSON line per mode, with its ratios to `sync`; goals (issue 12): one_step_off >= 1.5x steps/s
when generation and training take similar time, held-out accuracy within 3 points of sync.

The warm start: --policy (default runs/tiny_math/sft/hf, which examples/tiny_math/run.sh writes).
When it is missing, the bench builds a short one first: prepare.py (the task and the tiny model),
then `megatron-rl sft examples/tiny_math/sft.yaml` for --sft-steps steps, one rank on core 0.

    python tools/bench/async_step.py [--policy runs/tiny_math/sft/hf] [--steps 8] [--modes sync,one_step_off]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_math"
# (label, overrides): the modes compared, sync first (the baseline)
MODES: dict[str, list[str]] = {
    "sync": ["rollout.async_mode=sync"],
    "one_step_off": ["rollout.async_mode=one_step_off"],
    "fully_async_s1": ["rollout.async_mode=fully_async", "rollout.max_staleness=1"],
    "fully_async_s2": ["rollout.async_mode=fully_async", "rollout.max_staleness=2"],
}
TRAINER_CORE, ENGINE_CORE = "0", "1"
GOALS = {"one_step_off": 1.5}  # steps/s against sync, when generation and training take similar time
ACCURACY_POINTS = 3.0  # held-out greedy accuracy within this many points of sync


def _run(cmd: list[str], log: Path, what: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise SystemExit(f"{what} failed ({proc.returncode}); log {log}:\n{tail}")


def _cli(*args: str) -> list[str]:
    return ["taskset", "-c", TRAINER_CORE, sys.executable, "-m", "megatron_rl.cli", *args]


def _one_rank(model: Path, train_data: Path, assets: Path, run_dir: Path) -> list[str]:
    """The overrides both runs share: `model` on `train_data` as one rank (EP=1), evaluated on the
    held-out rows of `assets`, into `run_dir`, no progress bar or TensorBoard."""
    return [
        f"model.hf_path={model}",
        f"data.train_path={train_data}",
        f"data.eval_path={assets / 'data' / 'heldout.jsonl'}",
        f"logging.run_dir={run_dir}",
        "parallel.expert_model_parallel_size=1",
        "logging.progress=false",
        "logging.backends=[]",
    ]


def prepare_assets(assets: Path, sft_rows: int) -> None:
    """The example's task data and tiny model (examples/tiny_math/prepare.py) into `assets`."""
    assets.mkdir(parents=True, exist_ok=True)
    prepare = [sys.executable, str(EXAMPLE / "prepare.py"), "--out", str(assets), "--sft-rows", str(sft_rows)]
    _run([*prepare, "--sft-correct-fraction", "0.4"], assets / "prepare.log", "prepare.py")


def build_warm_start(work: Path, assets: Path, sft_steps: int) -> Path:
    """A short SFT warm start from `assets` under `work`; its HF folder."""
    if not (assets / "data" / "sft.jsonl").is_file():
        raise SystemExit(f"{assets}/data/sft.jsonl is missing: run examples/tiny_math/prepare.py --out {assets}")
    sft = _cli("sft", str(EXAMPLE / "sft.yaml"))
    sft += _one_rank(assets / "model", assets / "data" / "sft.jsonl", assets, work / "sft")
    sft += [f"train.steps={sft_steps}", f"train.lr_warmup_steps={max(sft_steps // 20, 1)}", "eval.max_prompts=50"]
    print(f"building a {sft_steps}-step SFT warm start in {work / 'sft'} ...", file=sys.stderr)
    _run(sft, work / "sft.log", "megatron-rl sft")
    return work / "sft" / "hf"


def run_mode(
    label: str, policy: Path, assets: Path, work: Path, args: argparse.Namespace, extra: list[str]
) -> list[dict]:
    """One mode end to end: a fresh engine on the engine core, the trainer on the trainer core."""
    from megatron_rl.metrics import read_metrics
    from megatron_rl.rollout.local.launcher import start_local_engine

    key = secrets.token_hex(16)
    engine = start_local_engine(
        str(policy),
        api_key=key,
        extra_args=["--threads", "1"],
        env={"OMP_NUM_THREADS": "1"},
        log_path=str(work / f"{label}-engine.log"),
        prefix=["taskset", "-c", ENGINE_CORE],
    )
    run_dir = work / label
    try:
        train = _cli("train", str(EXAMPLE / "rl.yaml"))
        train += _one_rank(policy, assets / "data" / "train.jsonl", assets, run_dir)
        train += [
            "rollout.engine=sglang",
            f"rollout.sglang_urls=[{engine.url}]",
            f"rollout.api_key={key}",
            f"rollout.n_samples_per_prompt={args.samples}",
            f"train.steps={args.steps}",
            f"train.prompts_per_step={args.prompts}",
            f"eval.every={args.steps}",
            f"eval.max_prompts={args.eval_prompts}",
            # one generation round per step, every group trained: each step is the same work in every mode
            "algorithm.dynamic_sampling=false",
            "checkpoint.every=0",
            "checkpoint.export_hf=false",
            *MODES[label],
            *extra,
        ]
        print(f"{label}: {args.steps} steps ...", file=sys.stderr)
        _run(train, work / f"{label}.log", f"megatron-rl train ({label})")
    finally:
        engine.stop()
    return read_metrics(run_dir)


def summarize(records: list[dict], warmup: int, samples_per_group: int) -> dict[str, Any]:
    """A mode's figures from its metrics records (see the module docstring)."""
    from rl_step import stage_seconds

    rows = stage_seconds(records, warmup)
    steps = [r for r in records if r.get("step", 0) > 0 and "time/elapsed" in r]
    # stage_seconds times each step from the previous step's end: the records of its rows, in order
    measured = [r for r in steps[1:] if r["step"] > warmup]
    assert len(measured) == len(rows)
    seconds = sum(r["step"] for r in rows)
    tokens = sum(float(r.get("throughput/train_tokens_per_s", 0.0)) * float(r.get("time/train", 0.0)) for r in measured)

    def idle(key: str) -> float | None:
        if not all(key in r for r in measured):
            return None
        return sum(float(r[key]) for r in measured) / seconds

    evals = [r for r in records if "eval/greedy_accuracy" in r]
    trained = sum(float(r.get("groups/groups_used", 0.0)) for r in steps) * samples_per_group
    return {
        "steps_measured": len(rows),
        "steps_per_s": len(rows) / seconds,
        "trained_tokens_per_s": tokens / seconds,
        "heldout_greedy_accuracy": float(evals[-1]["eval/greedy_accuracy"]) if evals else None,
        "heldout_greedy_accuracy_start": float(evals[0]["eval/greedy_accuracy"]) if evals else None,
        "trained_samples": trained,
        "trainer_idle_share": idle("time/wait_batch"),
        "engine_idle_share": idle("time/engine_idle"),
        "generate_share": sum(float(r.get("time/generate", 0.0)) for r in measured) / seconds,
        "train_share": sum(float(r.get("time/train", 0.0)) for r in measured) / seconds,
    }


def with_ratios(label: str, figures: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    line = {"mode": label, **figures, "baseline": "sync"}
    for key in ("steps_per_s", "trained_tokens_per_s"):
        line[f"{key}_ratio"] = figures[key] / base[key] if base[key] else None
    if figures["heldout_greedy_accuracy"] is not None and base["heldout_greedy_accuracy"] is not None:
        points = 100 * (figures["heldout_greedy_accuracy"] - base["heldout_greedy_accuracy"])
        line["accuracy_points_vs_sync"] = points
        if label != "sync":
            line["accuracy_goal_met"] = abs(points) <= ACCURACY_POINTS
    if label in GOALS:
        line["steps_per_s_goal"] = GOALS[label]
        line["steps_per_s_goal_met"] = (
            line["steps_per_s_ratio"] is not None and line["steps_per_s_ratio"] >= GOALS[label]
        )
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", type=Path, default=REPO / "runs/tiny_math/sft/hf", help="warm-start HF folder")
    parser.add_argument("--assets", type=Path, default=REPO / "runs/tiny_math/assets", help="prepare.py output")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, sync first; from {list(MODES)}")
    parser.add_argument("--steps", type=int, default=8, help="RL steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of the rates")
    parser.add_argument("--prompts", type=int, default=8, help="train.prompts_per_step")
    parser.add_argument("--samples", type=int, default=8, help="rollout.n_samples_per_prompt")
    parser.add_argument("--eval-prompts", type=int, default=100, help="held-out prompts of the greedy evaluation")
    parser.add_argument(
        "--sft-steps", type=int, default=120, help="steps of the warm start built when --policy is missing"
    )
    parser.add_argument("--work-dir", type=Path, default=None, help="keep runs and logs here (default: a temp folder)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of rl.yaml for every mode (after --)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes or modes[0] != "sync":
        raise SystemExit(f"--modes {args.modes!r}: start with sync, then any of {list(MODES)[1:]} (unknown: {unknown})")
    if args.steps <= args.warmup + 1:
        raise SystemExit(f"--steps {args.steps}: need more than --warmup {args.warmup} + 1 steps to measure")
    if subprocess.run(["taskset", "-c", ENGINE_CORE, "true"], capture_output=True).returncode != 0:
        raise SystemExit(f"taskset -c {ENGINE_CORE} failed: the bench needs 2 cores (trainer on 0, engine on 1)")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

    with tempfile.TemporaryDirectory(prefix="mrl-bench-async-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        policy, assets = args.policy, args.assets
        if not (assets / "data" / "train.jsonl").is_file():
            assets = work / "assets"
            prepare_assets(assets, args.sft_steps * 128)
        if not (policy / "config.json").is_file():
            policy = build_warm_start(work, assets, args.sft_steps)
        base = None
        for label in modes:
            records = run_mode(label, policy, assets, work, args, list(args.overrides))
            figures = summarize(records, args.warmup, args.samples)
            base = base or figures
            print(json.dumps(with_ratios(label, figures, base)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
