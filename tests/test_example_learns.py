"""End to end, the reduced-size example learns: prepare -> short SFT warm start -> a few RL steps.

The example's own commands and configs (examples/tiny_math: prepare.py, sft.yaml, rl.yaml with
DAPO and its learning rate), on 2 ranks (EP=2) with the local engine, seeded. The warm start is
short (its held-out greedy accuracy is low, but some samples are right) and is built once per test
session (tests/mrl_runs.py `tiny_math_warm_start`; test_sft checks its outputs). The claim: after
RL_STEPS steps, greedy accuracy on the held-out prompts is higher than before RL, by at least MIN_GAIN.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.metrics import read_metrics

from mrl_runs import EXAMPLE, WarmStart, cli_on_ranks

pytestmark = pytest.mark.e2e  # every test here launches (or uses a launch of) an engine or ranks

RL_STEPS, EVAL_PROMPTS = 4, 200
MIN_GAIN = 0.10


@pytest.mark.slow
def test_rl_raises_heldout_accuracy(warm_start: WarmStart, tmp_path: Path) -> None:
    run = tmp_path / "rl"
    cli_on_ranks(
        2,
        "train",
        str(EXAMPLE / "rl.yaml"),
        f"model.hf_path={warm_start.policy}",
        f"data.train_path={warm_start.assets / 'data' / 'train.jsonl'}",
        f"data.eval_path={warm_start.assets / 'data' / 'heldout.jsonl'}",
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
