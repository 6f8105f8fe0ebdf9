"""End to end, the reduced-size example learns: prepare -> short SFT warm start -> a few RL steps.

The example's own commands and configs (examples/tiny_math: prepare.py, sft.yaml, rl.yaml with
DAPO and its learning rate), on 2 ranks (EP=2) with the local engine, seeded. The warm start is
short (its held-out greedy accuracy is low, but some samples are right) and is built once per test
session. The claim: after RL_STEPS steps, greedy accuracy on the held-out prompts is higher than
before RL, by at least MIN_GAIN.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from megatron_rl.metrics import read_metrics

import prepare
from mrl_runs import rank_launcher

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny_math"

SFT_STEPS, SFT_ROWS = 300, 96  # 10.0% -> 31.0% (2026-12-06); 300 x 128: 18.5% -> 63.5%; 300 x 64: 5.5% -> 12.5%, short
RL_STEPS, EVAL_PROMPTS = 4, 200
MIN_GAIN = 0.10
TIMEOUT_S = 600


def _launch(*args: str, log: Path) -> None:
    cmd = rank_launcher(2)
    cmd += ["-m", "megatron_rl.cli", *args, "logging.progress=false", "logging.backends=[]"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as handle:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
    assert proc.returncode == 0, log.read_text()[-5000:]


@pytest.fixture(scope="session")
def warm_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(assets, warm-start HF folder): the example's SFT stage, shortened to SFT_STEPS steps."""
    root = tmp_path_factory.mktemp("tiny_math_learns")
    assets = root / "assets"
    rows = ["--sft-rows", str(SFT_STEPS * SFT_ROWS), "--sft-correct-fraction", "0.4"]  # as run.sh
    assert prepare.main(["--out", str(assets), *rows]) == 0
    _launch(
        "sft",
        str(EXAMPLE / "sft.yaml"),
        f"model.hf_path={assets / 'model'}",
        f"data.train_path={assets / 'data' / 'sft.jsonl'}",
        "data.eval_path=null",
        f"logging.run_dir={root / 'sft'}",
        f"train.steps={SFT_STEPS}",
        f"train.prompts_per_step={SFT_ROWS}",
        f"train.lr_warmup_steps={SFT_STEPS // 20}",
        log=root / "sft.log",
    )
    return assets, root / "sft" / "hf"


@pytest.mark.slow
def test_rl_raises_heldout_accuracy(warm_start: tuple[Path, Path], tmp_path: Path) -> None:
    assets, policy = warm_start
    run = tmp_path / "rl"
    _launch(
        "train",
        str(EXAMPLE / "rl.yaml"),
        f"model.hf_path={policy}",
        f"data.train_path={assets / 'data' / 'train.jsonl'}",
        f"data.eval_path={assets / 'data' / 'heldout.jsonl'}",
        f"logging.run_dir={run}",
        f"train.steps={RL_STEPS}",
        f"eval.every={RL_STEPS}",
        f"eval.max_prompts={EVAL_PROMPTS}",
        "checkpoint.export_hf=false",
        log=tmp_path / "rl.log",
    )
    evals = [(r["step"], r["eval/greedy_accuracy"]) for r in read_metrics(run) if "eval/greedy_accuracy" in r]
    assert [step for step, _ in evals] == [0, RL_STEPS]
    (_, before), (_, after) = evals
    assert before < 0.5, f"the warm start is not in the regime RL is tested in: greedy accuracy {before}"
    assert after >= before + MIN_GAIN, f"held-out greedy accuracy {before:.3f} -> {after:.3f} after {RL_STEPS} steps"
